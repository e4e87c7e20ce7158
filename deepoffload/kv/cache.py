"""``StorageCache``: a transformers ``Cache`` whose keys and values live in append-only files, read a layer ahead.

Each attention layer has two files in the cache's own run folder, or spread over one run folder per drive when given
several (``layer<i>.keys``, ``layer<i>.values``:
``layer.StorageLayer``, ``stream.ByteStream``). ``update(keys, values, i)`` takes layer ``i``'s stored tokens from the
read started earlier (or reads them now), returns them followed by the new ones exactly as ``DynamicLayer.update``
does, appends the new ones to the files and starts reading the next ``resident_layers - 1`` layers (wrapping to
layer 0 for the next forward), so layer ``i + 1``'s bytes come in while layer ``i`` computes. At most
``resident_layers`` layers' keys and values are in memory at once: the one being computed and those read ahead.

A failed write (a full disk) keeps its bytes in memory; the error (``OSError`` with errno and path) is raised by the
next forward's first ``update`` before it changes anything, or by ``close``; the cache stays exact and goes on in
memory. Used by one thread at a time: an ``update`` while another thread's is running raises ``UnsupportedError``.
``close()`` (or leaving a ``with`` block, or the end of the process) removes the files; the next run in the same
folder removes those of a process that died.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from ..errors import ClosedError, UnsupportedError
from ..swap.config import SwapConfig
from ..swap.drive_handles import DriveHandles
from ..swap.folder_checks import create_swap_file
from ..swap.layouts.multi_folder import MultiFolder
from ..swap.pool import trim_heap
from .layer import StorageLayer
from .stream import ByteStream, ReadBuffers, StreamRead

RESIDENT_LAYERS = 2
FLUSH_BYTES = 1 << 20
TRIM_BYTES = 16 << 20  # bytes of layers assembled between two trims of the heap (see ``update``)


def _full_attention_layers(config: Any) -> int:
    """The model's layer count; refuses configurations whose layers are not all full attention."""
    if config is None or not hasattr(config, "get_text_config"):
        raise TypeError(f"StorageCache: config must be the model's transformers config, got {type(config).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedError(
            "StorageCache: encoder-decoder models are not supported (generate wraps the cache with a cross-attention "
            "cache); use a DynamicCache"
        )
    text = config.get_text_config(decoder=True)
    kinds, _ = get_layer_types_and_kwargs(text)
    other = sorted({kind for kind in kinds if kind != "full_attention"})
    if other:
        raise UnsupportedError(
            f"StorageCache: layers of kind {', '.join(other)} (sliding window, chunked, linear attention or shared "
            f"KV) are not supported, only full attention; use a DynamicCache(config=...) for this model"
        )
    return len(kinds)


class StorageCache(Cache):
    """A transformers ``Cache`` on storage: pass it as ``generate(..., cache=...)`` or a forward's ``cache=``.

    Args:
        path: The base folder of the cache's run folder (None: the temp folder), or a list of folders, one per
            drive: a run folder under each, the layers' files placed over them by ``swap.folder_speeds`` (equal
            shares without), each drive with its own IO queue; folders on one device count once. On tmpfs it warns
            (the files stay in memory); on a file system without O_DIRECT the op reads and writes buffered.
        config: The model's transformers config (every layer must be full attention).
        resident_layers: Layers' keys and values in memory at once (>= 1): the one computing and
            ``resident_layers - 1`` read ahead.
        flush_bytes: Bytes a layer's keys (or values) gather in memory before they are written (rounded up to
            whole pages); at most this much per file stays in memory between forwards.
        swap: aio settings, ``keep_files`` and ``trust_folder_owner`` (its ``folder`` is replaced by ``path``).

    Raises:
        ValueError: When ``resident_layers`` < 1 or ``flush_bytes`` < 1.
        TypeError: When ``config`` is not a transformers config.
        UnsupportedError: For layers other than full attention, or an encoder-decoder model.

    Examples:
        >>> import torch, transformers, deepoffload
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> with deepoffload.StorageCache(".", config=config) as cache:
        ...     out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, cache=cache)
        >>> out.shape
        torch.Size([1, 7])
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
        *,
        config: Any,
        resident_layers: int = RESIDENT_LAYERS,
        flush_bytes: int = FLUSH_BYTES,
        swap: SwapConfig | None = None,
    ):
        for name, value in (("resident_layers", resident_layers), ("flush_bytes", flush_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StorageCache: {name} must be an integer >= 1, got {value!r}")
        self.layer_count = _full_attention_layers(config)
        super().__init__(layers=[])
        self.resident_layers = resident_layers
        self.flush_bytes = flush_bytes
        folder = path if path is None or isinstance(path, (str, os.PathLike)) else tuple(os.fspath(p) for p in path)
        self.swap = (swap or SwapConfig()).replace(**({} if folder is None else {"folder": folder}))
        if isinstance(self.swap.folder, str):  # one folder: created if missing, as every single swap folder is
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.swap.folder)
        # a run folder on each drive (dead runs' folders removed there), removed at close or collection
        self.layout = MultiFolder(self.swap)
        self.folders, self.folder = list(self.layout.folders), self.layout.folder
        self.drives = DriveHandles(self.layout, self.swap.aio)  # each drive its own queue
        self.storage_layers: list[StorageLayer] = []  # self.layers, typed
        self._reads: dict[int, tuple[StreamRead, StreamRead]] = {}
        self._buffers = ReadBuffers(2 * (resident_layers + 1))  # keys and values of the resident layers, one more
        self._lock = threading.Lock()
        self._assembled = 0  # bytes of layers assembled in fresh tensors
        self._trimmed = 0  # fresh bytes (read buffers, assembled layers) at the last trim of the heap
        self.closed = False

    # -- the update ---------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s stored keys and values followed by the new ones; store the new ones.

        Args:
            key_states: New keys ``[batch, heads, tokens, head_dim]``.
            value_states: New values.
            layer_idx: The layer.
            *args: Ignored (as by ``DynamicLayer``).
            **kwargs: Ignored (as by ``DynamicLayer``).

        Returns:
            Keys and values ``[batch, heads, stored + new tokens, head_dim]`` (contiguous, the new ones' device).

        Raises:
            ClosedError: After ``close``.
            UnsupportedError: While another thread is in an update of this cache, or for new tokens of another batch
                size, head count or dtype.
            OSError: At the first update of a forward (layer 0), when a write of an earlier one failed (errno, path,
                offset; its bytes stay in memory and the cache is unchanged), or when a read fails.
        """
        if not self._lock.acquire(blocking=False):
            raise UnsupportedError(
                "StorageCache: update from two threads at once; a cache holds one generation's state and is used by "
                "one thread at a time (give each thread a StorageCache of its own)"
            )
        try:
            self._check_open()
            if layer_idx == 0:
                self._raise_write_error()
            layer = self._layer(layer_idx)
            if not layer.is_initialized:
                layer.lazy_initialization(key_states, value_states)
            layer.check(key_states, value_states)
            reads = self._reads.pop(layer_idx, None) or layer.start_read(self._buffers)
            keys, values = layer.past_and_new(reads, key_states, value_states)
            del reads
            self._trim(0 if keys._base is not None else keys.nbytes + values.nbytes)
            layer.append(key_states, value_states)
            if layer_idx:  # the previous layer's writes ran while this one computed: let their buffers go
                self.storage_layers[layer_idx - 1].settle()
            self._read_ahead(layer_idx)
            return keys, values
        finally:
            self._lock.release()

    def _trim(self, assembled: int) -> None:
        """Give freed heap pages back to the system every ``TRIM_BYTES`` of read buffers allocated.

        Args:
            assembled: Bytes of a layer assembled in a fresh tensor (0 when handed out in place).

        Read buffers (and, where a read's buffer has no room for the new tokens, assembled layers) above glibc's
        initial mmap threshold raise it when freed, and later ones come from the heap, whose freed pages stay in the
        process until ``malloc_trim`` (``swap.pool.trim_heap``).
        """
        self._assembled += assembled
        if self._buffers.allocated + self._assembled - self._trimmed >= TRIM_BYTES:
            self._trimmed = self._buffers.allocated + self._assembled
            trim_heap()

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("StorageCache: used after close(); its files are gone. Make a new StorageCache")
        self.layout.check()

    def _layer(self, index: int) -> StorageLayer:
        if index >= self.layer_count:
            raise UnsupportedError(f"StorageCache: layer {index} of a model with {self.layer_count} layers (config)")
        while len(self.layers) <= index:
            count = len(self.layers)
            self.storage_layers.append(StorageLayer(self._stream(count, "keys"), self._stream(count, "values")))
            self.layers.append(self.storage_layers[-1])
        return self.storage_layers[index]

    def _stream(self, index: int, kind: str) -> ByteStream:
        path = os.path.join(self.folders[self.layout.next_drive()], f"layer{index}.{kind}")  # files by drive speed
        create_swap_file(path)
        return ByteStream(self.drives.of(path), path, self.flush_bytes)

    def _streams(self) -> list[ByteStream]:
        return [s for layer in self.storage_layers for s in (layer.key_stream, layer.value_stream)]

    def _read_ahead(self, index: int) -> None:
        """Start reading the ``resident_layers - 1`` layers after ``index`` (wrapping), unless started."""
        for step in range(1, min(self.resident_layers, self.layer_count)):
            ahead = (index + step) % self.layer_count
            layers = self.storage_layers
            if ahead < len(layers) and ahead not in self._reads and layers[ahead].get_seq_length():
                self._reads[ahead] = layers[ahead].start_read(self._buffers)

    def _raise_write_error(self) -> None:
        for stream in self._streams():
            stream.settle()  # the last forward's writes: so a failure is raised here, between two forwards
        errors = [error for stream in self._streams() if (error := stream.take_error()) is not None]
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} other files of this cache)" if len(errors) > 1 else ""
            raise OSError(first.errno, f"{first.strerror}{more}", first.filename)

    # -- the rest of the Cache API ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every stored token (the reads ahead are dropped)."""
        self._drop_reads()
        super().reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the beams (no file is rewritten; reads ahead stay valid).

        Args:
            beam_idx: ``[batch]`` indices into the current beams.
        """
        super().reorder_cache(beam_idx)

    def _drop_reads(self) -> None:
        for reads in self._reads.values():
            for read in reads:
                try:
                    read.wait()
                except OSError:  # a dropped read's failure changes nothing: its bytes are never used
                    continue
        self._reads.clear()

    def stats(self) -> dict[str, int]:
        """Bytes moved and held.

        Returns:
            ``bytes_written``, ``bytes_read`` (file bytes), ``bytes_in_memory`` (the tails: tokens not yet written),
            ``bytes_stored`` (every stored token's keys and values) and ``tokens``.
        """
        streams = self._streams()
        return {
            "bytes_written": sum(s.bytes_written for s in streams),
            "bytes_read": sum(s.bytes_read for s in streams),
            "bytes_in_memory": sum(s.tail_bytes for s in streams),
            "bytes_stored": sum(s.nbytes for s in streams),
            "tokens": self.get_seq_length(),
        }

    # -- lifetime -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the IO in flight, close the handle and remove the files (unless ``keep_files``); idempotent.

        Write errors not yet raised are dropped with the cache (its tokens are discarded).
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self._drop_reads()
                for stream in self._streams():
                    stream.settle()
            finally:
                self.drives.close()
                self.layout.close()  # (not when keep_files)

    def __enter__(self) -> "StorageCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
