"""Bytes as users write them ("6GB", "512MiB") and this process's memory as the kernel counts it.

These are what memory limits (``max_memory=``) are made of.
"""

from __future__ import annotations

import re

from .pool import trim_heap

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_bytes(value: int | str, what: str = "max_memory") -> int:
    """``value`` as bytes: an int, or a string such as "6GB" (10^9), "512MiB" (2^20) or "1.5GB"."""
    if isinstance(value, bool):
        raise TypeError(f"{what}={value!r}: expected bytes (an int) or a string such as '6GB'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{what}={value!r}: expected a positive number of bytes")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what}={value!r}: expected bytes (an int) or a string such as '6GB'")
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{what}={value!r}: expected bytes such as '6GB', '6000MB' or '512MiB' (units: "
            f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    nbytes = int(float(match.group(1)) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"{what}={value!r}: expected a positive number of bytes")
    return nbytes


def process_bytes() -> int:
    """This process's resident anonymous memory now, after giving freed heap memory back (``malloc_trim``).

    Returns:
        Bytes (``RssAnon`` of /proc/self/status); 0 where the system does not say.
    """
    trim_heap()
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # no /proc here: the system does not say (0, documented)
        pass
    return 0


def limit_with_room(least: int) -> str:
    """A ``max_memory`` that works when passed at the next call: ``least`` bytes and room for the process to grow.

    ``least`` counts this process's memory now, which grows as it runs (a page between two calls already), so the
    least itself is refused when passed back; the room is a twentieth of it, at least 16 MB, rounded up to whole MB.

    Args:
        least: The least limit that works now, in bytes.

    Returns:
        The limit as ``max_memory`` takes it, e.g. ``'316MB'``.
    """
    return f"{-(-(least + max(16 * 10**6, least // 20)) // 10**6)}MB"
