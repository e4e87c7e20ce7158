"""``ReadPlan``: where the bytes of one ``swap_in`` come from, and where each group lands in its one staging buffer.

Groups follow each other in the buffer, each from a page boundary. A group's range of its file is read whole: a
packed group's part of its extent, a mapped group's range from the page holding its first byte to its last byte
(file and buffer then share their alignment, for direct reads), any other group's file from its start. Ranges
adjacent both in one file and in the buffer become one request. A group stored encoded is read apart and decoded
into its place once read.
"""

from __future__ import annotations

from typing import Collection, Iterable

from .pool import PAGE_SIZE, round_up
from .records import SwapRecord, group_span


class ReadPlan:
    """The read of some groups, planned group by group with ``add``.

    Attributes:
        layout: ``{group: (start, records)}``: a tensor lands at ``start`` + its record's offset in the buffer.
        total: The buffer's bytes.
        spans: ``(file, offset in it, start in the buffer, bytes)`` to read, adjacent ranges merged.
        encoded: ``(a record of an encoded group, start in the buffer, bytes decoded)`` to read apart and decode.
    """

    def __init__(self) -> None:
        self.layout: dict[str, tuple[int, dict[str, SwapRecord]]] = {}
        self.total = 0
        self.spans: list[tuple[str, int, int, int]] = []
        self.encoded: list[tuple[SwapRecord, int, int]] = []

    def add(
        self,
        group: str,
        records: dict[str, SwapRecord],
        placed: tuple[int, int] | None,
        mapped: bool,
        left_out: Collection[str] = (),
    ) -> None:
        """Plan the read of ``group`` after the groups added before it.

        Args:
            group: The group's name.
            records: Its records in force (empty: nothing to read).
            placed: Packed: ``(offset, bytes)`` of its part of its extent (records hold file offsets), else None.
            mapped: It is served from another file (``map_group``) and has records.
            left_out: Keys of the group not to read (not in the result): only the pages of the others are read, in
                their places in the buffer.
        """
        sparse = bool(left_out)
        if sparse:
            records = {key: r for key, r in records.items() if key not in left_out}
        total = self.total
        if placed is not None:
            base, span = placed
            length = span
        elif mapped:
            base = min(r.offset for r in records.values()) // PAGE_SIZE * PAGE_SIZE
            length = max(r.offset + r.nbytes for r in records.values()) - base  # exactly: not past its end
            span = round_up(length)
        else:
            span, base = group_span(records.values()), 0
            length = span
            first = next(iter(records.values()), None)
            if span and first is not None and first.codec != "none":  # read its stored bytes, decode at wait
                self.encoded.append((first, total, span))
                self.layout[group] = (total, records)
                self.total += span
                return
        self.layout[group] = (total - base, records)
        if span and sparse and placed is None:
            for start, end in runs(records.values(), base, exact=mapped):
                self.spans.append((next(iter(records.values())).file, start, total + start - base, end - start))
        elif span:
            file = next(iter(records.values())).file
            spans = self.spans
            if (
                spans
                and spans[-1][0] == file
                and spans[-1][1] + spans[-1][3] == base
                and spans[-1][2] + spans[-1][3] == total
            ):
                spans[-1] = (*spans[-1][:3], spans[-1][3] + length)  # adjacent on storage and in the buffer
            else:
                spans.append((file, base, total, length))
        self.total += span


def runs(records: Iterable[SwapRecord], base: int, exact: bool = False) -> list[tuple[int, int]]:
    """The file ranges ``(start, end)`` holding ``records`` (from ``base`` on, from page starts), adjacent ones merged.

    Args:
        records: The records to read.
        base: The first file offset read.
        exact: Each range ends where its last tensor ends (a file served in place may end there), else at a page end.

    Returns:
        ``(start, end)`` file offsets, ascending.
    """
    found: list[tuple[int, int]] = []
    for r in sorted(records, key=lambda r: r.offset):
        start = max(base, r.offset // PAGE_SIZE * PAGE_SIZE)
        end = r.offset + r.nbytes if exact else round_up(r.offset + r.nbytes)
        if found and start <= found[-1][1]:
            found[-1] = (found[-1][0], max(end, found[-1][1]))
        else:
            found.append((start, end))
    return found
