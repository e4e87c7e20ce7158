"""``crc32(data, value=0)``: the zip CRC-32 (the values of ``zlib.crc32``), from the fastest library installed.

Large buffers go to libdeflate's ``libdeflate_crc32`` when the system has libdeflate (carry-less multiply: about 3x
the standard library's zlib on one core here, which made the CRC the largest part of a save's time); else to
zlib-ng when it is installed (``pip install zlib-ng``), else to the standard library's zlib. All release the GIL on
large buffers (libdeflate is called through ``ctypes``, which releases it). Small and read-only buffers go to zlib.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable

try:
    from zlib_ng.zlib_ng import crc32 as _zlib_crc32
except ImportError:
    from zlib import crc32 as _zlib_crc32

LIBDEFLATE_MIN_BYTES = 64 << 10  # smaller buffers: the ctypes call would cost more than it saves


def _libdeflate() -> Callable[[int, int, int], int] | None:
    """Return libdeflate's ``crc32(value, address, nbytes)``, or None where the library is not installed."""
    name = ctypes.util.find_library("deflate")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).libdeflate_crc32
    except (OSError, AttributeError):  # an unloadable or unrelated library: zlib instead
        return None
    function.restype = ctypes.c_uint32
    function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return function


_deflate_crc32 = _libdeflate()


def crc32(data, value: int = 0) -> int:
    """Return the CRC-32 of ``data`` continuing from ``value``, exactly as ``zlib.crc32(data, value)``.

    Args:
        data: A bytes-like object.
        value: The CRC of the bytes before ``data`` (0 to start).

    Returns:
        The CRC-32, an unsigned 32-bit integer.
    """
    if _deflate_crc32 is None:
        return _zlib_crc32(data, value)
    view = memoryview(data)
    if view.nbytes < LIBDEFLATE_MIN_BYTES or view.readonly or not view.c_contiguous:
        return _zlib_crc32(data, value)
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return _deflate_crc32(value & 0xFFFFFFFF, address, view.nbytes)


def backend() -> str:
    """Return which library computes large CRCs: ``"libdeflate"``, ``"zlib-ng"`` or ``"zlib"``."""
    if _deflate_crc32 is not None:
        return "libdeflate"
    return "zlib-ng" if _zlib_crc32.__module__.startswith("zlib_ng") else "zlib"


__all__ = ["backend", "crc32"]
