"""The figures a ``ParameterOffload`` reports (its ``stats``), gathered from its store and its optimizers.

The blocks' IO and memory come from the ``BlockStore``, the optimizer state's IO and staging from each
``OffloadedOptimizer``'s swapper, the time spent stepping from the training mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .blocks.residency import nbytes
from .stats import OffloadStats

if TYPE_CHECKING:
    from .offload import ParameterOffload


def gather(offload: ParameterOffload) -> OffloadStats:
    """``ParameterOffload.stats``: the offload's figures since it was made (its peaks since ``reset_peak``)."""
    state_read = state_written = 0
    for optimizer in offload.optimizers:
        state_read += optimizer.swapper.bytes_read
        state_written += optimizer.swapper.bytes_written
    store = offload.store
    return OffloadStats(
        bytes_read=store.bytes_read,
        bytes_written=store.bytes_written,
        state_bytes_read=state_read,
        state_bytes_written=state_written,
        io_wait_seconds=store.io_wait,
        optimizer_seconds=offload.training.optimizer_seconds,
        resident_bytes=store.resident_bytes(),
        peak_bytes=store.peak,
        grad_bytes=store.grad_bytes,
        peak_grad_bytes=store.peak_grad,
        block_bytes=max((b.nbytes + b.compute_nbytes for b in offload.blocks), default=0),
        rest_bytes=nbytes(offload.rest),
        staging_bytes=store.staging_bytes() + sum(o.swapper.pool.held_bytes() for o in offload.optimizers),
    )
