"""``crc32(data, value=0)``: the zip CRC-32 (the values of ``zlib.crc32``), from the fastest library installed.

That is zlib-ng when it is installed (``pip install zlib-ng``: several times faster on CPUs with carry-less
multiply), else the standard library's zlib. Both release the GIL on large buffers.
"""

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:
    from zlib import crc32

__all__ = ["crc32"]
