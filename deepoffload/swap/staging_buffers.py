"""Staging buffers of ``TensorSwapper``: every transfer goes through one, taken from its bounded pool.

``_StagingBuffers`` is what ``TensorSwapper`` inherits for them: acquiring a buffer (waiting for a write in flight to
free one), a buffer leaving the pool while views of it stay in use, copying a group's tensors into a buffer for a
write (skipped where a tensor already sits there), whether all of them already sit there, and a group's bytes
encoded into a one-off buffer.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import torch

from .pool import round_up
from .records import SwapRecord, _hash

if TYPE_CHECKING:
    from .codecs import ByteCodec
    from .config import SwapConfig
    from .packed import Extent
    from .pool import BufferPool
    from .transfers import SwapOut


class _StagingBuffers:
    """``TensorSwapper``'s staging buffers; the attributes below are set by ``TensorSwapper.__init__``."""

    config: SwapConfig
    pool: BufferPool
    _extents: dict[str, Extent]
    _pending_out: collections.deque[SwapOut]
    _group_alignment: int

    def _stage(
        self, group: str, entries: dict, buffer: torch.Tensor, start: int, file: str, base: int
    ) -> tuple[dict[str, SwapRecord], int]:
        """Copy a group's tensors into ``buffer`` from ``start`` (unless already there) and zero its padding.

        Returns:
            The group's records (offsets: ``base`` + offset in the group) and its span (bytes, page-aligned).
        """
        group_records, end = {}, 0
        checksum = None
        for key, (local, spec, offset) in entries.items():
            nbytes = local.numel() * local.element_size()
            region = buffer[start + offset : start + offset + nbytes]
            if nbytes and region.data_ptr() != local.data_ptr():
                region.view(local.dtype).view(local.shape).copy_(local)
            if self.config.checksum:
                checksum = _hash(region)
            group_records[key] = SwapRecord(
                key, local.dtype, tuple(local.shape), nbytes, file, base + offset, local.device, checksum, spec
            )
            end = offset + nbytes
        span = round_up(end, self._group_alignment)
        if span > end:
            buffer[start + end : start + span].zero_()  # no stale bytes in the file's padding
        return group_records, span

    def _forget(self, buffer: torch.Tensor) -> None:
        """``buffer`` leaves the pool (views of it stay in use); no extent keeps views of it for reuse."""
        self.pool.forget(buffer)
        for extent in set(self._extents.values()):
            if extent.views is not None and extent.views[0] is buffer:
                extent.views = None

    def _acquire(self, nbytes: int, prefer: torch.Tensor | None = None) -> torch.Tensor:
        """A staging buffer of ``nbytes`` (``prefer`` when it is free).

        Returns:
            A pooled buffer, waiting for the oldest write to free one if needed, or a one-off buffer when nothing in
            flight can free one (the pool's bound is then exceeded only briefly).
        """
        while True:
            buffer = self.pool.try_acquire(nbytes, prefer)
            if buffer is not None:
                return buffer
            if not self._pending_out:
                return self.pool.one_off(nbytes)
            try:
                self._pending_out[0].wait()
            except OSError:
                pass  # reported to whoever waits for that write; its buffer left the pool, so look again

    def _encoded(self, codec: ByteCodec, region: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``region`` encoded with ``codec`` into a one-off aligned buffer, zero-padded to whole pages.

        Returns:
            The padded bytes to write, and the encoded length.

        Raises:
            ValueError: When the codec reports a length outside the room ``max_stored_bytes`` promised.
        """
        room = codec.max_stored_bytes(region.numel())
        out = self.pool.one_off(room)  # whole pages
        nbytes = codec.encode(region, out)
        if not isinstance(nbytes, int) or not 0 <= nbytes <= room:
            raise ValueError(f"codec {codec.name!r}: encode returned {nbytes!r}, outside its max_stored_bytes")
        end = round_up(nbytes)
        out[nbytes:end].zero_()
        return out[:end], nbytes

    @staticmethod
    def _in_place(layout: dict, buffer: torch.Tensor, alignment: int) -> bool:
        """True when every tensor already sits in ``buffer`` exactly where ``layout`` puts it."""
        base, start = buffer.data_ptr(), 0
        for entries in layout.values():
            end = 0
            for local, _, offset in entries.values():
                nbytes = local.numel() * local.element_size()
                if nbytes and (
                    local.device.type != "cpu" or not local.is_contiguous() or local.data_ptr() != base + start + offset
                ):
                    return False
                end = offset + nbytes
            start += round_up(end, alignment)
        return start <= buffer.numel()
