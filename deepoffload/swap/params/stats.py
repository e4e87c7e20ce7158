"""``OffloadStats``: the figures a ``ParameterOffload`` reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadStats:
    """Figures of a ``ParameterOffload`` since it was made (or since ``reset_peak`` for the peaks). Bytes, seconds.

    bytes_read / bytes_written: storage traffic of block parameters and gradients.
    state_bytes_read / state_bytes_written: storage traffic of the offloaded optimizer state.
    io_wait_seconds: time the calling thread was blocked on parameter and gradient reads and writes.
    optimizer_seconds: time spent in optimizer steps of blocks (their state IO included).
    resident_bytes / peak_bytes: block parameter bytes in memory now / at most: staging buffers being read, in use
        or being written, plus compute-dtype copies. Parameters outside blocks are ``rest_bytes`` (always resident).
    grad_bytes / peak_grad_bytes: block gradient bytes in memory (before they reach storage or the optimizer).
    block_bytes: the largest block's parameter bytes in memory when resident (stored dtype plus compute copy).
    rest_bytes: parameters outside blocks (always in memory).
    staging_bytes: pooled staging buffers held now, for parameters and optimizer state (reused, page-aligned).
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
