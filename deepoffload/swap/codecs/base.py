"""``ByteCodec``: how a group's bytes are stored (encoded) and read back (decoded) exactly.

Every registered codec round-trips tensors bit for bit (``tests/swap/test_swap_seams.py``).

A ``TensorSwapper`` stages a group's tensors into one contiguous range of a buffer (page-aligned, zero padding
between tensors) and, unless its codec is the identity, stores that range encoded; the records then name the codec
and the encoded length, so a read decodes them with the codec they were written with. ``max_stored_bytes`` bounds
the encoded size for planning (buffers, disk space) before anything is encoded.

To add a codec: subclass ``ByteCodec`` in a file of its own and register it by name
(``deepoffload.swap.codecs.register_codec``); ``SwapConfig(codec=name)`` then selects it.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


class ByteCodec(abc.ABC):
    """Encodes a range of bytes for storage and decodes it back exactly.

    Attributes:
        name: The name it is registered under (set by ``register_codec``), recorded with every record it encodes.
        description: One line for ``deepoffload report``'s table of extensions.
        identity: True for the codec that stores bytes as they are: the swapper then skips it (no copy, no cost).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    identity: ClassVar[bool] = False

    @abc.abstractmethod
    def max_stored_bytes(self, nbytes: int) -> int:
        """The most bytes ``encode`` may produce from ``nbytes`` bytes (for planning buffers and disk space).

        Args:
            nbytes: The bytes to encode.

        Returns:
            An upper bound of the encoded length.
        """

    @abc.abstractmethod
    def encode(self, source: torch.Tensor, out: torch.Tensor) -> int:
        """Encode ``source`` into the start of ``out``.

        Args:
            source: Contiguous CPU ``uint8`` bytes to encode.
            out: Contiguous CPU ``uint8`` room of at least ``max_stored_bytes(source.numel())`` bytes.

        Returns:
            The encoded length (bytes of ``out`` used).
        """

    @abc.abstractmethod
    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> int:
        """Decode ``stored`` (what ``encode`` produced) into the start of ``out``.

        Args:
            stored: Contiguous CPU ``uint8``: exactly the encoded bytes.
            out: Contiguous CPU ``uint8`` room for the decoded bytes (at least as many as were encoded).

        Returns:
            The decoded length; the swapper refuses a length other than the one encoded (``ChecksumError``).
        """
