"""The packed layout of a ``TensorSwapper``: all groups in one pack file.

The groups of one ``swap_out`` call go in one page-aligned extent, written with one request; a read of one whole
extent into the buffer it was last read into hands back the same view objects.

``PackFile`` hands out extents first-fit from the ranges freed earlier (merged with their neighbours), else at the
end of the file, and cuts the file short when its last extent is freed, so the file stays about as large as the
live extents. An ``Extent`` lists the groups it holds, in order, with each group's byte range inside it; it is freed
once none of them lives there any more (each was rewritten elsewhere or discarded).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from typing import TYPE_CHECKING, Callable

import torch

from .pool import round_up
from .records import _hash
from .transfers import SwapIn, SwapOut

if TYPE_CHECKING:
    from .tensor_swapper import Groups, TensorSwapper

PACKED_ALIGNMENT = 16  # packed: bytes between tensors and between groups (any dtype's item size divides it), so
# many small tensors (e.g. Adam's 4-byte ``step``) do not each cost a cache line on storage


class Extent:
    """``nbytes`` bytes at byte ``offset`` of ``pack.path`` holding ``members``.

    ``members``: group -> (start, span) in bytes, relative to ``offset``, in write order. ``live``: the members whose
    current records point here.
    """

    __slots__ = ("pack", "offset", "nbytes", "members", "names", "live", "views")

    def __init__(self, pack: "PackFile", offset: int, nbytes: int, members: dict[str, tuple[int, int]]):
        self.pack, self.offset, self.nbytes, self.members = pack, offset, nbytes, members
        self.names = list(members)
        self.live: set[str] = set()
        self.views: tuple | None = None  # the swapper's last views of this extent in a staging buffer, for reuse

    def holds_exactly(self, members: dict[str, tuple[int, int]]) -> bool:
        """True when ``members`` (same groups, order, starts and spans) all live here: a rewrite fits in place."""
        return self.live == set(members) and list(self.members.items()) == list(members.items())

    def leave(self, group: str) -> None:
        """``group`` no longer lives here; the last one out frees the extent."""
        self.live.discard(group)
        if not self.live:
            self.pack.free(self)


class PackFile:
    """Page-aligned extents allocated in one file at ``path`` (created by the first write)."""

    def __init__(self, path: str):
        self.path = path
        self.end = 0  # bytes from the start of the file to the end of its last allocated extent
        self._free: list[tuple[int, int]] = []  # (offset, nbytes), sorted, merged

    def allocate(self, nbytes: int, members: dict[str, tuple[int, int]]) -> Extent:
        """A new extent of ``nbytes`` (a multiple of the page size) for ``members``; no group lives there yet."""
        for i, (offset, size) in enumerate(self._free):
            if size >= nbytes:
                if size == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (offset + nbytes, size - nbytes)
                return Extent(self, offset, nbytes, members)
        offset, self.end = self.end, self.end + nbytes
        return Extent(self, offset, nbytes, members)

    def free(self, extent: Extent) -> None:
        """Give an extent's bytes back (merged with free neighbours); a free tail is cut from the file."""
        if extent.nbytes == 0:
            return
        offset, nbytes = extent.offset, extent.nbytes
        extent.nbytes = 0  # freed once only
        extent.views = None
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and offset + nbytes == self._free[i][0]:
            nbytes += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, nbytes = self._free[i - 1][0], self._free[i - 1][1] + nbytes
            i -= 1
            del self._free[i]
        if offset + nbytes >= self.end:
            self.end = offset
            try:
                os.truncate(self.path, self.end)
            except FileNotFoundError:
                pass
        else:
            self._free.insert(i, (offset, nbytes))

    def free_bytes(self) -> int:
        """Bytes inside the file not held by any extent."""
        return sum(size for _, size in self._free)


class PackedLayout:
    """A packed ``TensorSwapper``'s writes and reads of whole extents of its pack file.

    The pack file is ``pack``, which is ``swapper.pack``; ``swapper._extents`` maps each group to the extent its
    current records point into.
    """

    def __init__(self, swapper: TensorSwapper, pack: PackFile):
        self.swapper = swapper
        self.pack = pack

    def swap_out(
        self,
        groups: Groups,
        layout: dict,
        buffer: torch.Tensor,
        buffers: list[torch.Tensor],
        on_done: Callable[[], None] | None,
    ) -> SwapOut:
        """All groups in one extent of the pack file (theirs, in place, when it holds exactly them), one request."""
        swapper = self.swapper
        members, start = {}, 0
        for group, entries in layout.items():
            span = round_up(
                max(
                    (offset + local.numel() * local.element_size() for local, _, offset in entries.values()), default=0
                ),
                PACKED_ALIGNMENT,
            )
            members[group] = (start, span)
            start += span
        total = round_up(start)
        if members and total > start:  # the last group's span reaches the extent's (page-aligned) end
            last = next(reversed(members))
            members[last] = (members[last][0], members[last][1] + total - start)
            buffer[start:total].zero_()
        extent = swapper._extents.get(next(iter(members), ""))
        if extent is None or not extent.holds_exactly(members):
            extent = self.pack.allocate(total, members)
        records = {}
        for group, entries in layout.items():
            begin, _ = members[group]
            records[group], _ = swapper._stage(group, entries, buffer, begin, self.pack.path, extent.offset + begin)
        requests = (
            [swapper.handle.write_async(buffer[:total], self.pack.path, extent.offset, truncate=False)] if total else []
        )
        write = SwapOut(
            swapper,
            requests,
            records,
            buffers,
            tuple(groups.values()),
            on_done,
            extent,
            shifts=dict.fromkeys(records, -extent.offset),
        )
        for group in records:
            swapper._writing[group] = write
        swapper._pending_out.append(write)
        return write

    def rewrite(self, groups: Groups, staged: SwapIn, on_done: Callable[[], None] | None) -> SwapOut | None:
        """Packed fast path: write the read buffer back over its extent, keeping the records, when that is right.

        It is when ``groups`` are exactly what ``staged`` read, all of one extent, as the same tensor objects
        (changed in place only).

        Args:
            groups: The groups to write.
            staged: The read they came from.
            on_done: As for ``TensorSwapper.swap_out``.

        Returns:
            The write in flight, or None (nothing done) when that does not hold.
        """
        swapper = self.swapper
        names = list(groups)
        extent = swapper._extents.get(names[0]) if names else None
        if (
            extent is None
            or extent.names != names
            or len(extent.live) != len(names)
            or list(staged._layout) != names
            or not all(staged.views_of_buffer(g, groups[g]) for g in names)
        ):
            return None
        return self.write_back(extent, staged, on_done, tuple(groups.values()))

    def write_back(self, extent: Extent, staged: SwapIn, on_done: Callable[[], None] | None, sources: tuple) -> SwapOut:
        """Write ``staged``'s buffer (a read of all of ``extent``) back over ``extent``, keeping the records."""
        swapper = self.swapper
        names = extent.names
        if swapper._writing:
            for group in names:
                swapper._wait_writing(group)
        staged._wait_io()
        buffer = staged._hand_over()
        if buffer is None:
            raise ValueError("write_back: the read's buffer was already released or handed to another write")
        records = {group: swapper._records[group] for group in names}
        if swapper.config.checksum:
            for group in names:
                start = staged._layout[group][0]
                records[group] = {
                    key: dataclasses.replace(
                        r, checksum=_hash(buffer[start + r.offset : start + r.offset + r.nbytes]) if r.nbytes else 0
                    )
                    for key, r in records[group].items()
                }
        request = swapper.handle.write_async(buffer[: extent.nbytes], self.pack.path, extent.offset, truncate=False)
        write = SwapOut(swapper, [request], records, [buffer], sources, on_done, extent, rewrite=True)
        writing = swapper._writing
        for group in names:
            writing[group] = write
        swapper._pending_out.append(write)
        return write

    def settle(self, groups: list[str], extent: Extent | None, ok: bool) -> None:
        """Record where ``groups`` live after a packed write to ``extent``; extents left empty are freed.

        They now live there (``ok``) or nowhere (the write failed, the bytes there are unknown).
        """
        if extent is None:
            return
        swapper = self.swapper
        for group in groups:
            old = swapper._extents.pop(group, None)
            if ok:
                swapper._extents[group] = extent
                extent.live.add(group)
            if old is not None and (old is not extent or not ok):
                old.leave(group)
        if not extent.live:
            self.pack.free(extent)

    def whole_extent(self, groups: list[str]) -> Extent | None:
        """Packed: the extent whose members are exactly ``groups``, in order, all living there; else None."""
        swapper = self.swapper
        extent = swapper._extents.get(groups[0]) if groups and swapper._extents else None
        if extent is None or len(extent.live) != len(groups) or extent.names != groups:
            return None  # live is a subset of the members: equal sizes and names mean all of them live there
        return extent

    def read_extent(self, groups: list[str], extent: Extent) -> SwapIn:
        """Read one whole extent with one request, into the buffer it was last read into when that is free."""
        swapper = self.swapper
        records = swapper._records
        layout = {group: (-extent.offset, records[group]) for group in groups}
        cached = extent.views
        buffer = swapper._acquire(extent.nbytes, prefer=cached[0] if cached is not None else None)
        request = swapper.handle.read_async(buffer[: extent.nbytes], self.pack.path, extent.offset)
        read = SwapIn(swapper, [request], layout, buffer, extent)
        reading = swapper._reading
        for group in groups:
            reading[group] = read
        return read
