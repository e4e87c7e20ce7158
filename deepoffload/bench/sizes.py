"""Byte sizes written by people: ``4096``, ``512K``, ``1M``, ``1G``, ``1GiB`` (suffixes are powers of 1024)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_PATTERN = re.compile(r"\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: an integer with an optional K, M, G or T suffix (also KiB, MiB, ...), powers of 1024.

    Args:
        text: The size as written (case and spaces around it do not matter).

    Returns:
        The number of bytes (at least 1).

    Raises:
        ValueError: For anything else, including zero; the message says what is accepted.
    """
    match = _PATTERN.fullmatch(str(text))
    if match is None:
        raise ValueError(
            f"not a size: {text!r}; use bytes with an optional K, M, G or T suffix (powers of 1024), "
            f"e.g. 4096, 512K, 1M, 1G"
        )
    nbytes = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if nbytes <= 0:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return nbytes


def format_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that divides it exactly (``1 GiB``, ``384 KiB``, ``1000003 B``)."""
    for suffix, unit in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit} {suffix}"
    return f"{nbytes} B"
