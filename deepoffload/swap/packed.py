"""The packed layout of a ``TensorSwapper``: all groups in the pack files its storage layout names (one by default).

The groups of one ``swap_out`` call go in one page-aligned extent (``extents.py``) of one pack file, written with one
request; each new extent goes to the pack file holding the fewest allocated bytes; a read of one whole
extent into the buffer it was last read into hands back the same view objects. ``PackedLayout`` keeps which extent
each group's current records point into; it knows its swapper only as a ``PackedOwner``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol

import torch

from .extents import Extent, PackFile
from .pool import round_up
from .records import SwapRecord, hash_bytes
from .transfers import SwapIn, SwapOut, TransferOwner

if TYPE_CHECKING:
    from .drive_handles import DriveHandles

Groups = Mapping[str, Mapping[str, torch.Tensor]]
PACKED_ALIGNMENT = 16  # packed: bytes between tensors and between groups (any dtype's item size divides it), so
# many small tensors (e.g. Adam's 4-byte ``step``) do not each cost a cache line on storage


class PackedOwner(TransferOwner, Protocol):
    """What ``PackedLayout`` needs of its swapper besides a transfer's needs (``TensorSwapper`` is one)."""

    io: DriveHandles  # the IO handle of each drive

    def current_records(self, group: str) -> dict[str, SwapRecord]:
        """The group's records in force (the swapper's own dict: read, never changed)."""
        ...

    def wait_writing(self, group: str) -> None:
        """Wait for a write of ``group`` in flight, if any."""

    def track_write(self, write: SwapOut, groups: Iterable[str]) -> None:
        """``write`` is in flight for ``groups``."""

    def track_read(self, read: SwapIn, groups: Iterable[str]) -> None:
        """``read`` is in flight for ``groups``."""


class PackedLayout:
    """A packed ``TensorSwapper``'s extents, and its writes and reads of whole extents of its pack file.

    Args:
        swapper: The swapper whose groups these are.
        packs: The pack files (the layout's ``pack_files()``): each new extent goes to the one holding the fewest
            allocated bytes per unit of weight, so a layout with a file per drive spreads a step's extents over its
            drives.
        weights: Each pack file's share (the layout's ``pack_weights()``; None: equal).

    Attributes:
        extents: Each group -> the extent its current records point into.
    """

    def __init__(self, swapper: PackedOwner, packs: list[PackFile], weights: list[float] | None = None):
        self.swapper = swapper
        self.packs = packs
        self.weights = {id(pack): w for pack, w in zip(packs, weights or [1.0] * len(packs))}
        self.extents: dict[str, Extent] = {}

    def forget_views(self, buffer: torch.Tensor) -> None:
        """No extent keeps views of ``buffer`` for reuse any more (it leaves the pool).

        Args:
            buffer: The buffer.
        """
        for extent in set(self.extents.values()):
            extent.forget_views(buffer)

    def leave(self, group: str) -> bool:
        """``group`` no longer lives in its extent (discarded); the last one out frees the extent.

        Args:
            group: The group.

        Returns:
            Whether it lived in one.
        """
        extent = self.extents.pop(group, None)
        if extent is not None:
            extent.leave(group)
        return extent is not None

    def span(self, group: str) -> tuple[int, int] | None:
        """Where ``group``'s bytes lie in the pack file.

        Args:
            group: The group.

        Returns:
            ``(offset, bytes)``, or None when it lives in no extent.
        """
        extent = self.extents.get(group)
        if extent is None:
            return None
        begin, span = extent.members[group]
        return extent.offset + begin, span

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
        extent = self.extents.get(next(iter(members), ""))
        if extent is None or not extent.holds_exactly(members):
            extent = min(self.packs, key=lambda p: p.allocated_bytes() / self.weights[id(p)]).allocate(total, members)
        records = {}
        for group, entries in layout.items():
            begin, _ = members[group]
            records[group], _ = swapper.staging.stage(
                group, entries, buffer, begin, extent.pack.path, extent.offset + begin
            )
        pack = extent.pack.path
        requests = (
            [swapper.io.of(pack).write_async(buffer[:total], pack, extent.offset, truncate=False)] if total else []
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
        swapper.track_write(write, records)
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
        names = list(groups)
        extent = self.extents.get(names[0]) if names else None
        if (
            extent is None
            or extent.names != names
            or len(extent.live) != len(names)
            or staged.groups() != names
            or not all(staged.views_of_buffer(g, groups[g]) for g in names)
        ):
            return None
        return self.write_back(extent, staged, on_done, tuple(groups.values()))

    def write_back_read(self, staged: SwapIn, on_done: Callable[[], None] | None) -> SwapOut | None:
        """``TensorSwapper.write_back``: ``staged``'s buffer written back over the extent it read whole, if it did.

        Args:
            staged: The read whose buffer is written back.
            on_done: As for ``TensorSwapper.swap_out``.

        Returns:
            The write in flight, or None (nothing done) when ``staged`` did not read a whole extent, or its groups
            live elsewhere now.
        """
        extent = staged.extent
        if (
            extent is None
            or not staged.holds_buffer()
            or self.extents.get(extent.names[0]) is not extent
            or len(extent.live) != len(extent.names)
            or staged.groups() != extent.names
        ):
            return None
        return self.write_back(extent, staged, on_done, tuple(staged.wait().values()))

    def write_back(self, extent: Extent, staged: SwapIn, on_done: Callable[[], None] | None, sources: tuple) -> SwapOut:
        """Write ``staged``'s buffer (a read of all of ``extent``) back over ``extent``, keeping the records."""
        swapper = self.swapper
        names = extent.names
        for group in names:
            swapper.wait_writing(group)
        staged.wait_io()
        buffer = staged.hand_over()
        if buffer is None:
            raise ValueError("write_back: the read's buffer was already released or handed to another write")
        records = {group: swapper.current_records(group) for group in names}
        if swapper.checksum:
            for group in names:
                start = staged.start(group)
                records[group] = {
                    key: dataclasses.replace(
                        r,
                        checksum=hash_bytes(buffer[start + r.offset : start + r.offset + r.nbytes]) if r.nbytes else 0,
                    )
                    for key, r in records[group].items()
                }
        pack = extent.pack.path
        request = swapper.io.of(pack).write_async(buffer[: extent.nbytes], pack, extent.offset, truncate=False)
        write = SwapOut(swapper, [request], records, [buffer], sources, on_done, extent, rewrite=True)
        swapper.track_write(write, names)
        return write

    def settle(self, groups: list[str], extent: Extent | None, ok: bool) -> None:
        """Record where ``groups`` live after a packed write to ``extent``; extents left empty are freed.

        They now live there (``ok``) or nowhere (the write failed, the bytes there are unknown).
        """
        if extent is None:
            return
        for group in groups:
            old = self.extents.pop(group, None)
            if ok:
                self.extents[group] = extent
                extent.live.add(group)
            if old is not None and (old is not extent or not ok):
                old.leave(group)
        if not extent.live:
            extent.pack.free(extent)

    def whole_extent(self, groups: list[str]) -> Extent | None:
        """Packed: the extent whose members are exactly ``groups``, in order, all living there; else None."""
        extent = self.extents.get(groups[0]) if groups and self.extents else None
        if extent is None or len(extent.live) != len(groups) or extent.names != groups:
            return None  # live is a subset of the members: equal sizes and names mean all of them live there
        return extent

    def read_extent(self, groups: list[str], extent: Extent) -> SwapIn:
        """Read one whole extent with one request, into the buffer it was last read into when that is free."""
        swapper = self.swapper
        layout = {group: (-extent.offset, swapper.current_records(group)) for group in groups}
        cached = extent.views
        buffer = swapper.staging.acquire(extent.nbytes, prefer=cached[0] if cached is not None else None)
        request = swapper.io.of(extent.pack.path).read_async(buffer[: extent.nbytes], extent.pack.path, extent.offset)
        read = SwapIn(swapper, [request], layout, buffer, extent)
        swapper.track_read(read, groups)
        return read
