"""Extents of a pack file: many groups of tensors in one file, each ``swap_out`` call one page-aligned extent.

``PackFile`` hands out extents first-fit from the ranges freed earlier (merged with their neighbours), else at the
end of the file, and cuts the file short when its last extent is freed, so the file stays about as large as the
live extents. An ``Extent`` lists the groups it holds, in order, with each group's byte range inside it; it is freed
once none of them lives there any more (each was rewritten elsewhere or discarded).
"""

from __future__ import annotations

import bisect
import os


class Extent:
    """``nbytes`` bytes at byte ``offset`` of ``pack.path`` holding ``members`` (group -> (start, span) in bytes,
    relative to ``offset``), in write order. ``live``: the members whose current records point here."""

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
