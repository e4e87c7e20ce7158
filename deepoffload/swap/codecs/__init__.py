"""Byte codecs: how a ``TensorSwapper`` stores a group's bytes (``ByteCodec``), one file per codec, registered.

Built in: ``none`` (``identity.py``: bytes as they are, skipped by the swapper) and ``lossless`` (``lossless.py``:
16-bit floats' exponent byte plane compressed with zstandard, bit for bit: ``tests/swap/test_codec_lossless.py``).
``SwapConfig(codec=name)`` selects one by name; to add one, write a ``ByteCodec`` subclass in a file of its own and
decorate it with ``register_codec(name)``.
"""

from __future__ import annotations

from . import identity as identity
from . import lossless as lossless
from .base import ByteCodec
from .registry import codec_class, codec_names, register_codec, unregister_codec

__all__ = ["ByteCodec", "codec_class", "codec_names", "register_codec", "unregister_codec"]
