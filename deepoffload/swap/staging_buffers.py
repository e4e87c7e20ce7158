"""``StagingBuffers``: a ``TensorSwapper``'s staging buffers; every transfer goes through one, from its bounded pool.

It acquires a buffer (waiting for the oldest write in flight to free one), lets a buffer leave the pool while views
of it stay in use, copies a group's tensors into a buffer for a write (skipped where a tensor already sits there),
tells whether all of them already sit there, and encodes a group's bytes into a one-off buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..pending import Pending
from .pool import BufferPool, round_up
from .records import SwapRecord, hash_bytes, slice_hashes

if TYPE_CHECKING:
    from .codecs import ByteCodec


class StagingBuffers:
    """The staging buffers of one swapper.

    Args:
        pool: The bounded pool the buffers come from (owned by this object).
        pending: The swapper's writes in flight, oldest first (its live deque): ``acquire`` waits for the oldest to
            free a buffer.
        checksum: Hash every tensor staged for a write (xxh3-64, into its record).
        group_alignment: Where each group starts in a buffer (bytes).
        on_forget: Called with a buffer that leaves the pool (whoever keeps views of it for reuse drops them).
    """

    def __init__(
        self,
        pool: BufferPool,
        pending: Sequence[Pending[int]],
        checksum: bool,
        group_alignment: int,
        on_forget: Callable[[torch.Tensor], None] | None = None,
    ):
        self.pool = pool
        self.group_alignment = group_alignment
        self._pending = pending
        self._checksum = checksum
        self._on_forget = on_forget

    def stage(
        self, group: str, entries: dict, buffer: torch.Tensor, start: int, file: str, base: int
    ) -> tuple[dict[str, SwapRecord], int]:
        """Copy a group's tensors into ``buffer`` from ``start`` (unless already there) and zero its padding.

        Args:
            group: The group's name.
            entries: ``{key: (tensor, DTensor description, offset in the group)}``.
            buffer: The staging buffer.
            start: Where the group starts in ``buffer`` (bytes).
            file: The file the records will name.
            base: The group's offset in ``file`` (bytes).

        Returns:
            The group's records (offsets: ``base`` + offset in the group) and its span (bytes, ``group_alignment``).
        """
        group_records, end = {}, 0
        checksum: int | None = None
        slices: tuple[int, ...] = ()
        for key, (local, spec, offset) in entries.items():
            nbytes = local.numel() * local.element_size()
            region = buffer[start + offset : start + offset + nbytes]
            if nbytes and region.data_ptr() != local.data_ptr():
                region.view(local.dtype).view(local.shape).copy_(local)
            if self._checksum:
                checksum, slices = hash_bytes(region), slice_hashes(region, tuple(local.shape))
            group_records[key] = SwapRecord(
                key,
                local.dtype,
                tuple(local.shape),
                nbytes,
                file,
                base + offset,
                local.device,
                checksum,
                spec,
                slices=slices,
            )
            end = offset + nbytes
        span = round_up(end, self.group_alignment)
        if span > end:
            buffer[start + end : start + span].zero_()  # no stale bytes in the file's padding
        return group_records, span

    def release(self, buffer: torch.Tensor) -> None:
        """Give ``buffer`` back to the pool; no view of it may be used afterwards.

        Args:
            buffer: A buffer from ``acquire``.
        """
        self.pool.release(buffer)

    def forget(self, buffer: torch.Tensor) -> None:
        """``buffer`` leaves the pool (views of it stay in use); nothing keeps views of it for reuse.

        Args:
            buffer: A buffer from ``acquire``.
        """
        self.pool.forget(buffer)
        if self._on_forget is not None:
            self._on_forget(buffer)

    def acquire(self, nbytes: int, prefer: torch.Tensor | None = None) -> torch.Tensor:
        """A staging buffer of ``nbytes`` (``prefer`` when it is free).

        Args:
            nbytes: The bytes needed.
            prefer: The buffer to hand out when it is free.

        Returns:
            A pooled buffer, waiting for the oldest write to free one if needed, or a one-off buffer when nothing in
            flight can free one (the pool's bound is then exceeded only briefly).
        """
        while True:
            buffer = self.pool.try_acquire(nbytes, prefer)
            if buffer is not None:
                return buffer
            if not self._pending:
                return self.pool.one_off(nbytes)
            try:
                self._pending[0].wait()
            except OSError:
                pass  # reported to whoever waits for that write; its buffer left the pool, so look again

    def encoded(self, codec: ByteCodec, region: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``region`` encoded with ``codec`` into a one-off aligned buffer, zero-padded to whole pages.

        Args:
            codec: The codec.
            region: The bytes to encode.

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
    def in_place(layout: dict, buffer: torch.Tensor, alignment: int) -> bool:
        """True when every tensor already sits in ``buffer`` exactly where ``layout`` puts it.

        Args:
            layout: ``{group: {key: (tensor, DTensor description, offset in the group)}}``.
            buffer: The buffer.
            alignment: Where each group starts (bytes).

        Returns:
            Whether no copy is needed.
        """
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
