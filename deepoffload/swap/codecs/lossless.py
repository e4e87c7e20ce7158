"""The ``lossless`` codec: 16-bit floats stored with their exponent byte plane entropy-coded (zstandard).

Values come back bit for bit (``tests/swap/test_codec_lossless.py``). A bf16 value's high byte holds its sign and 7 of
its 8 exponent bits (fp16: sign, exponent, 2 mantissa bits); across a weight tensor those bytes carry about 2.6 bits of
entropy, its low bytes (mantissa) nearly 8. So the bytes are split into two planes: the high bytes compressed with
zstandard (level 1), the low bytes stored as they are. On real bf16 weights that stores about 0.68 of the bytes
(``docs/guides/codec.md``; ``benchmarks/codec.py`` measures it). Bytes that are not 16-bit floats (float32 norms,
padding) round-trip too, compressed less or not at all.

Stored layout (little-endian): a 32-byte header ``magic (4) | version (1) | 3 zero bytes | decoded length (8) |
compressed high plane length (8) | xxh3-64 of the decoded bytes (8)``, then the compressed high plane, then the low
plane (with the odd last byte, if any). ``decode`` checks the hash: a changed stored byte anywhere is an error, which
the swapper reports as a ``ChecksumError`` naming the file.

Needs the ``zstandard`` package (``pip install deepoffload[codec]``); it is imported when the codec is first made.
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ..records import hash_bytes
from .base import ByteCodec
from .registry import register_codec

if TYPE_CHECKING:
    import torch

MAGIC = b"DOLZ"
VERSION = 1
HEADER = struct.Struct("<4sB3xQQQ")  # magic, version, decoded length, compressed high plane length, xxh3-64
LEVEL = 1  # zstd level: 3 and above store no fewer bytes of an exponent plane here and encode 2-3x slower


def _zstandard() -> Any:
    """The ``zstandard`` module, or a ``ConfigError`` saying how to install it."""
    try:
        import zstandard
    except ImportError as e:
        raise ConfigError(
            "codec='lossless' needs the zstandard package: pip install 'deepoffload[codec]' (or zstandard); "
            "codec='none' needs nothing"
        ) from e
    return zstandard


@register_codec("lossless")
class Lossless(ByteCodec):
    """16-bit floats' high (exponent) byte plane compressed with zstandard, the low plane as it is."""

    description = (
        "bf16/fp16 exponent byte plane compressed with zstandard, values unchanged (pip install deepoffload[codec])"
    )

    def __init__(self) -> None:
        self._zstandard = _zstandard()
        self._error = self._zstandard.ZstdError
        self._local = threading.local()  # zstandard's (de)compressors are not to be used by two threads at once

    @property
    def _compressor(self) -> Any:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = self._zstandard.ZstdCompressor(level=LEVEL)
        return compressor

    @property
    def _decompressor(self) -> Any:
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = self._zstandard.ZstdDecompressor()
        return decompressor

    def max_stored_bytes(self, nbytes: int) -> int:
        """The header, the low plane, and zstandard's bound for the high plane (or the plane as it is, if larger).

        Args:
            nbytes: The bytes to encode.

        Returns:
            An upper bound of the encoded length.
        """
        half = nbytes // 2
        return HEADER.size + (nbytes - half) + half + (half >> 8) + 1024

    def encode(self, source: torch.Tensor, out: torch.Tensor) -> int:
        """Split ``source`` into byte planes and write the header, the compressed high plane and the low plane.

        Args:
            source: Contiguous CPU ``uint8`` bytes.
            out: Room of at least ``max_stored_bytes(source.numel())`` bytes.

        Returns:
            The encoded length.
        """
        import torch

        nbytes = source.numel()
        half = nbytes // 2
        pairs = source[: 2 * half].view(half, 2)
        high = self._compressor.compress(pairs[:, 1].contiguous().numpy())
        start = HEADER.size
        out[start : start + len(high)].copy_(torch.frombuffer(bytearray(high), dtype=torch.uint8) if high else out[:0])
        start += len(high)
        out[start : start + half].copy_(pairs[:, 0])
        start += half
        if nbytes % 2:
            out[start : start + 1].copy_(source[-1:])
            start += 1
        header = HEADER.pack(MAGIC, VERSION, nbytes, len(high), hash_bytes(source))
        out[: HEADER.size].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        return start

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> int:
        """Decompress the high plane, interleave it with the low plane into ``out`` and check the hash.

        Args:
            stored: Exactly the encoded bytes.
            out: Room for the decoded bytes.

        Returns:
            The decoded length.

        Raises:
            ValueError: When the stored bytes are not this codec's, are cut short, or decode to bytes whose hash
                differs from the one recorded (the swapper reports it as a ``ChecksumError`` naming the file).
        """
        import numpy as np

        if stored.numel() < HEADER.size:
            raise ValueError(f"{stored.numel()} stored bytes: shorter than the {HEADER.size}-byte header")
        magic, version, nbytes, high_bytes, digest = HEADER.unpack(stored[: HEADER.size].numpy().tobytes())
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not a lossless record (magic {magic!r}, version {version})")
        half = nbytes // 2
        if stored.numel() != HEADER.size + high_bytes + (nbytes - half) or out.numel() < nbytes:
            raise ValueError(f"{stored.numel()} stored bytes do not hold a record of {nbytes} bytes")
        body = stored.numpy()
        try:
            high = self._decompressor.decompress(body[HEADER.size : HEADER.size + high_bytes], max_output_size=half)
        except self._error as e:
            raise ValueError(f"the high byte plane does not decompress: {e}") from e
        if len(high) != half:
            raise ValueError(f"the high byte plane decompresses to {len(high)} bytes, not {half}")
        pairs = out.numpy()[: 2 * half].reshape(half, 2)
        pairs[:, 1] = np.frombuffer(high, dtype=np.uint8)
        low = HEADER.size + high_bytes
        pairs[:, 0] = body[low : low + half]
        if nbytes % 2:
            out.numpy()[nbytes - 1] = body[low + half]
        if hash_bytes(out[:nbytes]) != digest:
            raise ValueError("the decoded bytes' xxh3-64 differs from the one recorded: the stored bytes changed")
        return nbytes
