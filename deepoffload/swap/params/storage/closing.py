"""How a ``ParameterOffload`` ends (``close``): its blocks read back into memory or discarded, its hooks undone.

With ``restore=True`` every block is read first (a pinned block's own memory becomes its parameters', uncopied), so a
block that cannot be read leaves everything open and as it was; then the blocks' parameters get their values. With
``restore=False`` the stored values are dropped. Either way the offload then counts as closed: the gradient guards,
the module's patches, the swap files, the optimizers' state files and the data-parallel hooks are removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..blocks.residency import Residency

if TYPE_CHECKING:
    from ..offload import ParameterOffload


def close(offload: ParameterOffload, restore: bool) -> None:
    """``ParameterOffload.close``: end offloading, first reading every block back into memory with ``restore``."""
    if offload._closed:
        return
    if restore:  # a failure here (a block unreadable) leaves everything open and as it was
        for block in offload.blocks:
            if block.in_memory and block.unwritable(block.changed()):
                offload.store.drop_unwritable(block)  # raises: a change that cannot be kept must not pass silently
        offload.training.finish_writes()
        offload.store.wait_writes()
        # a pinned block's memory is its own: it becomes the parameters' (no copy)
        values = [
            block.master_tensors() if block.state is Residency.PINNED else offload.store.read_copy(block)
            for block in offload.blocks
        ]
    try:
        if restore:
            for block, tensors in zip(offload.blocks, values):
                offload.store.restore(block, tensors)
        else:
            offload.training.finish_writes()
            offload.store.wait_writes()
            for block in offload.blocks:
                offload.store.release(block, keep_changes=False)
                block.discarded = True
    finally:
        offload._closed = True
        for block in offload.blocks:
            block.unguard_grads()
        offload.patches.remove(restore)
        offload.store.close()
        for optimizer in offload.optimizers:
            optimizer.close()
        if offload.data_parallel is not None:
            offload.data_parallel.close()
