"""Extents of a pack file: ``PackFile`` hands out page-aligned byte ranges of one file, an ``Extent`` is one of them.

``PackFile`` hands out extents first-fit from the ranges freed earlier (merged with their neighbours), else at the
end of the file, and cuts the file short when its last extent is freed, so the file stays about as large as the
live extents. An ``Extent`` lists the groups it holds, in order, with each group's byte range inside it; it is freed
once none of them lives there any more (each was rewritten elsewhere or discarded). It also keeps the views a read
of it made last, so a read of it into the same buffer hands back the same view objects.
"""

from __future__ import annotations

import bisect
import os

import torch


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

    def cached_views(self, buffer: torch.Tensor | None, records: list) -> dict | None:
        """The views kept by ``keep_views`` when they were made of ``buffer`` from these same record objects.

        Args:
            buffer: The staging buffer just read into.
            records: Each group's records dict, in order (compared by identity: unchanged records, same views).

        Returns:
            A copy of the kept ``{group: {key: view}}``, or None.
        """
        cached = self.views
        if cached is None or cached[0] is not buffer or len(cached[1]) != len(records):
            return None
        if not all(a is b for a, b in zip(cached[1], records)):
            return None
        return dict(cached[2])

    def keep_views(self, buffer: torch.Tensor, records: list, tensors: dict) -> None:
        """Keep ``tensors`` (views of ``buffer`` made from ``records``) for the next read of this extent into it.

        Args:
            buffer: The staging buffer.
            records: Each group's records dict, in order.
            tensors: ``{group: {key: view}}``.
        """
        self.views = (buffer, records, dict(tensors))

    def forget_views(self, buffer: torch.Tensor) -> None:
        """Drop the kept views when they are views of ``buffer`` (which leaves the pool).

        Args:
            buffer: The buffer.
        """
        if self.views is not None and self.views[0] is buffer:
            self.views = None

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
            except FileNotFoundError:  # the file was never written (or the run folder is gone): nothing to cut
                pass
        else:
            self._free.insert(i, (offset, nbytes))

    def allocated_bytes(self) -> int:
        """Bytes of the file held by extents.

        Returns:
            The bytes.
        """
        return self.end - self.free_bytes()

    def free_bytes(self) -> int:
        """Bytes inside the file not held by any extent."""
        return sum(size for _, size in self._free)
