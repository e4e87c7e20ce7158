"""``StorageLayer``: one attention layer's keys and values in two append-only files (transformers' layer API).

The layer keeps no keys or values of its own between forwards: ``past`` builds them from a read of its two streams
(``stream.ByteStream``, token-major rows), ``append`` adds a forward's new tokens. Beam search's reordering never
rewrites a file: ``rows[t, b]`` says which stored batch row is the beam ``b`` of token ``t``, and ``past`` gathers
by it (a copy of the same values). Cropping and changing the batch size of a filled layer are refused.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..errors import UnsupportedError
from .stream import ByteStream, ReadBuffers, StreamRead


def _refused(what: str) -> str:
    return (
        f"StorageCache: {what} is not supported: its files are append-only and one batch size wide. Use a "
        f"DynamicCache for assisted decoding, prompt lookup, contrastive search or batch changes"
    )


def _wait_both(reads: tuple[StreamRead, StreamRead]) -> None:
    """Wait for both reads, then raise the first one's failure: no read is left in flight into a buffer."""
    errors = []
    for read in reads:
        try:
            read.wait()
        except OSError as e:
            errors.append(e)
    if errors:
        raise errors[0]


class StorageLayer(CacheLayerMixin):
    """One layer's cache: keys in one stream, values in another, a beam map, its length in tokens.

    Args:
        keys: The stream of its keys.
        values: The stream of its values.
    """

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, keys: ByteStream, values: ByteStream):
        super().__init__()
        self.key_stream = keys
        self.value_stream = values
        self.length = 0  # tokens stored
        self.rows: torch.Tensor | None = None  # [length, batch] stored batch rows; None: identity
        self.shapes: tuple[torch.Size, torch.Size] | None = None  # keys' and values' [batch, heads, 1, dim]
        self.dtypes: tuple[torch.dtype, torch.dtype] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Record the batch, heads, head sizes, dtypes and device of the first keys and values.

        Args:
            key_states: ``[batch, heads, tokens, head_dim]``.
            value_states: ``[batch, heads, tokens, head_dim]``.
        """
        self.device = key_states.device
        self.shapes = (
            torch.Size((*key_states.shape[:2], 1, key_states.shape[3])),
            torch.Size((*value_states.shape[:2], 1, value_states.shape[3])),
        )
        self.dtypes = (key_states.dtype, value_states.dtype)
        self.is_initialized = True

    def check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse new tokens whose batch, heads, head size or dtype differ from the stored ones.

        Args:
            key_states: The new keys.
            value_states: The new values.

        Raises:
            UnsupportedError: When they differ.
        """
        for states, shape, dtype in zip((key_states, value_states), self.shapes or (), self.dtypes or ()):
            if states.dim() != 4 or (*states.shape[:2], 1, states.shape[3]) != tuple(shape) or states.dtype != dtype:
                raise UnsupportedError(
                    _refused(
                        f"new keys or values of shape {tuple(states.shape)} and {states.dtype} after "
                        f"{tuple(shape)} (tokens as 1) and {dtype}: a change of batch, heads or dtype"
                    )
                )

    def start_read(self, buffers: ReadBuffers) -> tuple[StreamRead, StreamRead]:
        """Start reading the layer's keys and values.

        Args:
            buffers: Where the reads go.

        Returns:
            The two reads.
        """
        return self.key_stream.start_read(buffers), self.value_stream.start_read(buffers)

    def settle(self) -> None:
        """Wait for the writes in flight of both streams (a failure is kept in the stream's ``error``)."""
        self.key_stream.settle()
        self.value_stream.settle()

    def _stored(self, read: StreamRead, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        data, _ = read.wait()
        rows = data.view(dtype).view(self.length, shape[0], shape[1], shape[3])
        if self.rows is not None:
            rows = rows[torch.arange(self.length).unsqueeze(1), self.rows]
        return rows.permute(1, 2, 0, 3)

    def past_and_new(
        self, reads: tuple[StreamRead, StreamRead], key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored tokens followed by the new ones, as ``DynamicLayer.update`` returns them (contiguous).

        Args:
            reads: The reads of the stored keys and values (``start_read``).
            key_states: The new keys ``[batch, heads, tokens, head_dim]``.
            value_states: The new values.

        Returns:
            Keys and values ``[batch, heads, stored + new tokens, head_dim]`` on the new ones' device: on the CPU,
            without a beam map and where the read's buffer has room, a view of that buffer (token-major, no copy of
            the stored tokens); else a contiguous copy as ``DynamicLayer.update``'s.

        Raises:
            OSError: When a read fails.
        """
        _wait_both(reads)
        out = []
        for read, new, shape, dtype in zip(reads, (key_states, value_states), self.shapes or (), self.dtypes or ()):
            tokens = self.length + new.shape[2]
            row = shape[0] * shape[1] * shape[3] * dtype.itemsize
            if self.rows is None and new.device.type == "cpu" and read.buffer.numel() >= tokens * row:
                # in place: the stored rows where the read put them, the new ones after them (token-major rows,
                # handed out as a [batch, heads, tokens, head_dim] view: attention gives the same bits)
                rows = read.buffer[: tokens * row].view(dtype).view(tokens, shape[0], shape[1], shape[3])
                rows[self.length :].copy_(new.permute(2, 0, 1, 3))
                out.append(rows.permute(1, 2, 0, 3))
                continue
            full = torch.empty((shape[0], shape[1], tokens, shape[3]), dtype=dtype, device=new.device)
            if self.length:
                full[:, :, : self.length].copy_(self._stored(read, shape, dtype))
            full[:, :, self.length :].copy_(new)
            out.append(full)
        return out[0], out[1]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append new tokens to the streams (token-major bytes).

        Args:
            key_states: The new keys ``[batch, heads, tokens, head_dim]``.
            value_states: The new values.
        """
        tokens = key_states.shape[2]
        for stream, states in ((self.key_stream, key_states), (self.value_stream, value_states)):
            rows = states.detach().to("cpu").permute(2, 0, 1, 3).contiguous()
            stream.append(rows.view(-1).view(torch.uint8))
        if self.rows is not None:
            fresh = torch.arange(self.rows.shape[1]).expand(tokens, -1)
            self.rows = torch.cat([self.rows, fresh])
        self.length += tokens

    # -- transformers' layer API -------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Not called: ``StorageCache.update`` runs a layer's update (it orders the reads of all layers).

        Args:
            key_states: The new keys.
            value_states: The new values.
            *args: Ignored.
            **kwargs: Ignored.

        Raises:
            UnsupportedError: Always.
        """
        raise UnsupportedError(_refused("a StorageLayer used outside its StorageCache"))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The attention mask's key length and offset, as a ``DynamicLayer``'s.

        Args:
            query_length: The new tokens.

        Returns:
            ``(stored + query_length, 0)``.
        """
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        """The stored tokens.

        Returns:
            The count.
        """
        return self.length

    def get_max_length(self) -> int:
        """No maximum.

        Returns:
            -1.
        """
        return -1

    def offload(self) -> None:
        """Nothing to do: the layer's tokens are on storage between forwards."""

    def prefetch(self) -> None:
        """Nothing to do: ``StorageCache`` starts the reads."""

    def reset(self) -> None:
        """Forget every stored token (the files are reused from their start)."""
        self.key_stream.reset()
        self.value_stream.reset()
        self.length = 0
        self.rows = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam ``b`` continues beam ``beam_idx[b]``: the beam map is gathered, no file changes.

        Args:
            beam_idx: ``[batch]`` indices into the current beams.

        Raises:
            UnsupportedError: When ``beam_idx`` changes the batch size.
        """
        if not self.length:
            return
        batch = self.shapes[0][0] if self.shapes else 0
        if beam_idx.dim() != 1 or beam_idx.numel() != batch:
            raise UnsupportedError(_refused(f"reorder_cache to {beam_idx.numel()} beams from {batch}"))
        rows = self.rows if self.rows is not None else torch.arange(batch).expand(self.length, -1)
        self.rows = rows[:, beam_idx.to("cpu", torch.long)].contiguous()

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)`` (nothing) is supported.

        Args:
            tokens_to_remove: Tokens to drop (negative) or 0.

        Raises:
            UnsupportedError: For anything but 0 on a filled layer.
        """
        if tokens_to_remove != 0 and self.length:
            raise UnsupportedError(_refused(f"crop({tokens_to_remove})"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused on a filled layer (changes the batch size).

        Args:
            repeats: Copies of each batch row.

        Raises:
            UnsupportedError: When the layer holds tokens.
        """
        if self.length:
            raise UnsupportedError(_refused("batch_repeat_interleave"))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refused on a filled layer (changes the batch size).

        Args:
            indices: Rows to keep.

        Raises:
            UnsupportedError: When the layer holds tokens.
        """
        if self.length:
            raise UnsupportedError(_refused("batch_select_indices"))
