"""``OffloadStats``: the figures a ``ParameterOffload`` reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .blocks.residency import Block, nbytes

if TYPE_CHECKING:
    from ..optimizer import OffloadedOptimizer
    from .storage.store import BlockStore


@dataclass(frozen=True)
class OffloadStats:
    """Figures of a ``ParameterOffload`` since it was made (or since ``reset_peak`` for the peaks).

    Sizes are in bytes, times in seconds. ``ParameterOffload.stats`` makes one.

    Attributes:
        bytes_read: Storage bytes read of block parameters and gradients.
        bytes_written: Storage bytes written of block parameters and gradients.
        state_bytes_read: Storage bytes read of the offloaded optimizer state.
        state_bytes_written: Storage bytes written of the offloaded optimizer state.
        io_wait_seconds: Time the calling thread was blocked on parameter and gradient reads and writes.
        optimizer_seconds: Time spent in optimizer steps of blocks (their state IO included).
        resident_bytes: Block parameter bytes in memory now: staging buffers being read, in use or being written,
            plus compute-dtype copies. Parameters outside blocks are ``rest_bytes`` (always resident).
        peak_bytes: The most block parameter bytes in memory (counted as ``resident_bytes``).
        grad_bytes: Block gradient bytes in memory now (before they reach storage or the optimizer).
        peak_grad_bytes: The most block gradient bytes in memory.
        block_bytes: The largest block's parameter bytes in memory when resident (stored dtype plus compute copy).
        rest_bytes: Parameters outside blocks (always in memory).
        staging_bytes: Pooled staging buffers held now, for parameters and optimizer state (reused, page-aligned).

    Examples:
        >>> import torch, deepoffload
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        >>> prefetch0 = deepoffload.StreamOptions(prefetch=0)
        >>> with deepoffload.offload_parameters(model, "swap", stream=prefetch0) as off, torch.no_grad():
        ...     y = model(torch.randn(2, 8))
        ...     stats = off.stats
        >>> stats.block_bytes  # 8 * 8 weights and 8 biases, float32
        288
        >>> stats.bytes_read > 0 and stats.bytes_written > 0
        True
        >>> stats.peak_grad_bytes  # inference: no gradients
        0
    """

    bytes_read: int
    bytes_written: int
    state_bytes_read: int
    state_bytes_written: int
    io_wait_seconds: float
    optimizer_seconds: float
    resident_bytes: int
    peak_bytes: int
    grad_bytes: int
    peak_grad_bytes: int
    block_bytes: int
    rest_bytes: int
    staging_bytes: int

    @classmethod
    def gather(
        cls,
        blocks: list[Block],
        rest: list,
        store: BlockStore,
        optimizers: list[OffloadedOptimizer],
        optimizer_seconds: float,
    ) -> OffloadStats:
        """The figures of a ``ParameterOffload`` from its parts (``ParameterOffload.stats``).

        Args:
            blocks: Its blocks.
            rest: Its parameters outside blocks.
            store: The blocks' store (their IO and memory).
            optimizers: Its optimizers (the optimizer state's IO and staging).
            optimizer_seconds: The time its training mode spent stepping.

        Returns:
            The figures since it was made (its peaks since ``reset_peak``).
        """
        state_read = sum(o.swapper.bytes_read for o in optimizers)
        state_written = sum(o.swapper.bytes_written for o in optimizers)
        return cls(
            bytes_read=store.bytes_read,
            bytes_written=store.bytes_written,
            state_bytes_read=state_read,
            state_bytes_written=state_written,
            io_wait_seconds=store.io_wait,
            optimizer_seconds=optimizer_seconds,
            resident_bytes=store.resident_bytes(),
            peak_bytes=store.peak,
            grad_bytes=store.grad_bytes,
            peak_grad_bytes=store.peak_grad,
            block_bytes=max((b.nbytes + b.compute_nbytes for b in blocks), default=0),
            rest_bytes=nbytes(rest),
            staging_bytes=store.staging_bytes() + sum(o.swapper.pool.held_bytes() for o in optimizers),
        )
