"""Dtype moves of a streamed model, converted block by block on storage.

Moves are ``model.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.double()`` on the model or a module
holding blocks: before torch converts the parameters in memory and the buffers, each block whose parameters the move
changes is read, converted with the same function torch applies and written back, one block at a time (a block held in
memory is converted where it is), so the result equals the model converted in memory. A move that would change a
streamed parameter's device is refused before anything is converted, and so are dtype moves of blocks computing with
``compute_dtype=`` copies or served read-only from a checkpoint.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..blocks.residency import Block, Residency, nbytes
from .store import BlockStore


def planned(blocks: Sequence[Block], fn: Callable[[torch.Tensor], torch.Tensor]) -> list[Block]:
    """The blocks whose parameters ``fn`` converts to another dtype.

    Args:
        blocks: The streamed blocks.
        fn: The conversion torch applies to each tensor.

    Returns:
        Those blocks, in order.

    Raises:
        ValueError: When ``fn`` would move a streamed parameter to another device, or convert a block that cannot
            be rewritten (one computing with ``compute_dtype=`` copies, or served read-only from a checkpoint).
    """
    todo = []
    for block in blocks:
        target = None  # the dtype the move converts a parameter to
        for name, param in zip(block.names, block.params):
            moved = fn(param.data)
            if moved.device != param.device:
                raise ValueError(
                    f"this would move the streamed parameter {block.qualified(name)} from "
                    f"{param.device} to {moved.device}, but its values live on storage and stream to "
                    f"{param.device}: move the model before offload_parameters() (blocks then stream to "
                    f"that device)"
                )
            if moved.dtype != param.dtype:
                target = moved.dtype
        if target is None:
            continue
        if block.compute_dtype is not None:
            raise ValueError(
                f"this would convert the streamed parameters of block {block.prefix}, which compute "
                f"with compute_dtype={block.compute_dtype} copies of their stored values: convert the "
                f"model before offload_parameters(), or offload it with stream=StreamOptions(compute_dtype={target}) "
                f"to compute in {target}"
            )
        read_only = block.source.read_only()
        if read_only is not None:
            raise ValueError(
                f"this would convert the parameters of block {block.prefix}, {read_only}: offload the model in "
                f"{target} (built on the meta device: load=LoadOptions(..., dtype={target}); in memory: "
                f"model.to({target}) first), or offload without serve_from_checkpoint="
            )
        todo.append(block)
    return todo


def convert(store: BlockStore, blocks: Sequence[Block], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Convert ``blocks``' stored values with ``fn`` block by block (see the module docstring)."""
    for block in blocks:
        held = store.hold_for_change(block)
        try:
            with torch.no_grad():
                for param in block.params:
                    param.data = fn(param.data)
        except BaseException:
            if not held:
                store.release(block, keep_changes=False)
            raise
        block.nbytes = nbytes(block.masters)
        store.fit_staging(block)
        block.record_versions()
        if block.state is Residency.RESIDENT:
            store.write_back(block)
        store.wait_write(block)
