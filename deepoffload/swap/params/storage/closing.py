"""How a ``ParameterOffload`` ends (``close``): its blocks read back into memory or discarded, its hooks undone.

With ``restore=True`` every block is read first (``read_back``: a pinned block's own memory becomes its parameters',
uncopied), so a block that cannot be read leaves everything open and as it was; then the blocks' parameters get their
values (``put_back``). With ``restore=False`` the stored values are dropped. Either way the offload then counts as
closed: the gradient guards, the module's patches, the swap files, the optimizers' state files and the data-parallel
hooks are removed (``detach``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..blocks.patches import ModulePatches
from ..blocks.residency import Block, Residency
from .store import BlockStore


class Closable(Protocol):
    """Something with a ``close()`` (optimizers, data-parallel hooks)."""

    def close(self) -> None:
        """Release what it holds."""


class Writes(Protocol):
    """The training mode's writes in flight."""

    def finish_writes(self) -> None:
        """Wait for them."""


def read_back(blocks: list[Block], store: BlockStore, training: Writes) -> list[dict[str, torch.Tensor]]:
    """Every block's master values, read (a pinned block's own, uncopied); raises before anything changed.

    Args:
        blocks: The blocks.
        store: Their store.
        training: The training mode (its writes are waited for first).

    Returns:
        Per block, its values by parameter name.
    """
    for block in blocks:
        if block.in_memory and block.unwritable(block.changed()):
            store.drop_unwritable(block)  # raises: a change that cannot be kept must not pass silently
    training.finish_writes()
    store.wait_writes()
    # a pinned block's memory is its own: it becomes the parameters' (no copy)
    return [block.master_tensors() if block.state is Residency.PINNED else store.read_copy(block) for block in blocks]


def put_back(
    blocks: list[Block], store: BlockStore, training: Writes, values: list[dict[str, torch.Tensor]] | None
) -> None:
    """Give the blocks' parameters ``values`` (from ``read_back``), or with None discard what storage holds.

    Args:
        blocks: The blocks.
        store: Their store.
        training: The training mode (its writes are waited for before discarding).
        values: What ``read_back`` returned, or None to discard.
    """
    if values is not None:
        for block, tensors in zip(blocks, values):
            store.restore(block, tensors)
        return
    training.finish_writes()
    store.wait_writes()
    for block in blocks:
        store.release(block, keep_changes=False)
        block.discarded = True


def detach(
    blocks: list[Block], store: BlockStore, others: list[Closable], restore: bool, patches: ModulePatches
) -> None:
    """Undo what offloading attached: gradient guards, the module's patches, swap files, then ``others``.

    Args:
        blocks: The blocks.
        store: Their store (its swap files are removed).
        others: The optimizers and the data-parallel hooks, closed in that order.
        restore: Whether the blocks were read back (the patches then restore what they replaced).
        patches: The ``ModulePatches`` attached to the module.
    """
    for block in blocks:
        block.unguard_grads()
    patches.remove(restore)
    store.close()
    for other in others:
        other.close()
