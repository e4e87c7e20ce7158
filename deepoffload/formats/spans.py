"""Span planning for ``CheckpointReader``.

Which byte ranges of which files to read, with one request each, to get a set of tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .header import TensorEntry, element_size

READ_ALIGNMENT = 4096  # spans start and end on this boundary (or at the end of the file) so O_DIRECT needs no bounce


@dataclass
class Span:
    """Neighbouring tensors of one file read by one request: bytes ``[start, end)`` of ``path``.

    A span with a ``piece`` holds bytes ``[lo, hi)`` (counted from the tensor's first byte) of its one tensor only.
    """

    path: str
    start: int
    end: int
    entries: list[TensorEntry] = field(default_factory=list)
    piece: tuple[int, int] | None = None


def plan_spans(
    entries: list[TensorEntry], span_bytes: int, gap_bytes: int, split: frozenset[str] = frozenset()
) -> list[Span]:
    """Plan the spans that read ``entries``.

    Args:
        entries: The tensors, in storage order (file by file, by offset).
        span_bytes: The most bytes a span of several tensors covers.
        gap_bytes: Neighbours closer than this share a span.
        split: Names of tensors that are read in pieces of at most a span each when larger than a span.

    Returns:
        The spans covering ``entries``, in order.
    """
    spans: list[Span] = []
    for entry in entries:
        if entry.name in split and entry.nbytes > span_bytes:
            spans.extend(pieces(entry, span_bytes))
            continue
        last = spans[-1] if spans else None
        if (
            last is not None
            and last.piece is None
            and last.path == entry.path
            and entry.start - last.end <= gap_bytes
            and entry.end - last.start <= span_bytes
        ):
            last.end = max(last.end, entry.end)
            last.entries.append(entry)
        else:
            spans.append(Span(entry.path, entry.start, entry.end, [entry]))
    return spans


def pieces(entry: TensorEntry, span_bytes: int) -> list[Span]:
    """Split ``entry`` into spans of at most ``span_bytes``.

    Pieces end on whole elements; where the tensor starts on a whole element of the file, they also end on the read
    alignment, so no byte is read twice.

    Args:
        entry: The tensor.
        span_bytes: The most bytes per piece.

    Returns:
        One span per piece, each with its ``piece`` bounds and an entry for its elements.
    """
    step = span_bytes // READ_ALIGNMENT * READ_ALIGNMENT
    shift = entry.start % READ_ALIGNMENT if entry.start % element_size(entry.dtype) == 0 else 0
    bounds = [0, *range(step - shift, entry.nbytes, step), entry.nbytes]
    size = element_size(entry.dtype)
    return [
        Span(
            entry.path,
            entry.start + lo,
            entry.start + hi,
            [dataclasses.replace(entry, start=entry.start + lo, end=entry.start + hi, shape=((hi - lo) // size,))],
            (lo, hi),
        )
        for lo, hi in zip(bounds, bounds[1:])
        if hi > lo
    ]
