"""The ``none`` codec: bytes stored as they are (the swapper skips it: no copy, no cost)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import ByteCodec
from .registry import register_codec

if TYPE_CHECKING:
    import torch


@register_codec("none")
class Identity(ByteCodec):
    """Stores bytes as they are; ``TensorSwapper`` never calls it (``identity``), others may."""

    description = "bytes stored as they are (the swapper skips it: no copy)"
    identity = True

    def max_stored_bytes(self, nbytes: int) -> int:
        """``nbytes``.

        Args:
            nbytes: The bytes to encode.

        Returns:
            ``nbytes``.
        """
        return nbytes

    def encode(self, source: torch.Tensor, out: torch.Tensor) -> int:
        """Copy ``source`` to ``out``.

        Args:
            source: The bytes.
            out: Where they go.

        Returns:
            ``source.numel()``.
        """
        out[: source.numel()].copy_(source)
        return source.numel()

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> int:
        """Copy ``stored`` to ``out``.

        Args:
            stored: The bytes.
            out: Where they go.

        Returns:
            ``stored.numel()``.
        """
        out[: stored.numel()].copy_(stored)
        return stored.numel()
