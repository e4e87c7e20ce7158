"""Read checkpoints tensor by tensor: safetensors files read through the async-IO op, torch.save files by mmap.

``CheckpointReader`` opens a checkpoint of any registered format (``registry``: a ``.safetensors`` file, a Hugging
Face sharded folder, a ``torch.save`` state dict, or one a user registered), validates it at open through its format,
and yields tensors lazily by
name, so a caller can load one block of a model at a time. Safetensors bytes are read with O_DIRECT (no page
cache) into page-aligned buffers (huge pages where the system has them, faulted in before each read is submitted,
while earlier reads are in flight): neighbouring tensors are read together in spans of up to ``span_bytes`` and
sliced, and up to ``inflight_bytes`` of spans are read ahead while the caller works on earlier ones.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import time
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from ..io.buffers import aligned_empty, drop_cached, page_out
from ..io.handle import AsyncIOHandle
from .checks import DtypeSpec, Expected, KeyReport, check_unchanged, compare_keys, convertible
from .fault_in import FAULT_SPLIT_PAGES, PAGE_BYTES, SLOW_FAULT_BYTES_PER_S, fault_in
from .header import (
    CheckpointError,
    Header,
    TensorEntry,
    check_little_endian,
    element_size,
)
from .registry import detect_format
from .spans import READ_ALIGNMENT, Span, plan_spans

NAMES_HINT = " (pass strict=False to allow missing and unexpected names)"


class CheckpointReader:
    """Lazy, validated access to the tensors of a checkpoint (see the module docstring for the layouts).

    Every header is validated at open. Tensors yielded from one span are views of its buffer: keeping one alive
    keeps the span's memory (at most ``span_bytes``, or that one tensor's size) alive; ``clone()`` it to drop the
    rest.

    Args:
        path: A checkpoint of a registered format (``deepoffload.formats.checkpoint_formats()``, the first whose
            ``detect`` accepts it): a ``.safetensors`` file, a folder of one (``model.safetensors``) or of sharded
            safetensors (with ``model.safetensors.index.json``), an ``.index.json`` file, a ``torch.save`` file (zip
            format), or one of a format added with ``register_format``. ``format`` then names its format and
            ``serves`` says whether its tensors' bytes lie as stored in files.
        handle: An ``AsyncIOHandle`` to read with (default: one made here with the default settings, closed by
            ``close()``).
        span_bytes: The largest read that covers several tensors (at least ``READ_ALIGNMENT``).
        inflight_bytes: How many bytes of spans are read ahead (at least ``READ_ALIGNMENT``).
        gap_bytes: Unrequested bytes between two requested tensors that are read through rather than splitting the
            span.

    Raises:
        ValueError: When ``span_bytes`` or ``inflight_bytes`` is not an integer of at least ``READ_ALIGNMENT``.
        CheckpointNotFoundError: (a ``CheckpointError`` and a ``FileNotFoundError``, errno ``ENOENT``, the missing
            path as ``filename``) When ``path``, the checkpoint in its folder or a shard its index lists is missing.
        CheckpointError: When a file is not a valid checkpoint.

    Examples:
        >>> import torch
        >>> from deepoffload.formats import CheckpointReader, save_file
        >>> _ = save_file({"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.int64)}, "model.safetensors")
        >>> with CheckpointReader("model.safetensors") as reader:
        ...     print(reader.names(), reader.shape_dtype("b"))
        ...     reader.read(["a"], dtype=torch.float16)
        ['a', 'b'] ((3,), torch.int64)
        {'a': tensor([1., 1.], dtype=torch.float16)}
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        handle: AsyncIOHandle | None = None,
        span_bytes: int = 64 << 20,
        inflight_bytes: int = 256 << 20,
        gap_bytes: int = 1 << 20,
    ):
        check_little_endian()
        for key, value in (("span_bytes", span_bytes), ("inflight_bytes", inflight_bytes)):
            if not isinstance(value, int) or value < READ_ALIGNMENT:
                raise ValueError(f"{key} must be an integer of at least {READ_ALIGNMENT} bytes, got {value!r}")
        self.path = Path(path)
        self.span_bytes, self.inflight_bytes, self.gap_bytes = span_bytes, inflight_bytes, max(0, gap_bytes)
        self._headers: list[Header] = []
        self._state_dict: dict[str, torch.Tensor] | None = None
        self.metadata: dict | None = None
        self._open()
        self._handle = handle
        self._own_handle = False
        self._pool: list[torch.Tensor] = []  # span buffers read_into reuses
        self._fault_threads = 1  # threads faulting in new span buffers (see SLOW_FAULT_BYTES_PER_S)

    # -- opening ----------------------------------------------------------------------------------------------
    def _open(self) -> None:
        fmt = detect_format(self.path)
        opened = fmt.open(self.path)
        self.format, self.serves = fmt.name, fmt.serves
        self.metadata = opened.metadata
        if opened.mapped is not None:
            self._state_dict = opened.mapped
            self._mapped_path, self._mapped_identity = opened.mapped_path, opened.mapped_identity
        else:
            self._headers = list(opened.files)
            self._entries = {name: entry for header in self._headers for name, entry in header.entries.items()}

    # -- what is in it ----------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Return every tensor's name, in storage order (shard by shard, by offset)."""
        return list(self._state_dict) if self._state_dict is not None else list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in (self._state_dict if self._state_dict is not None else self._entries)

    def __len__(self) -> int:
        return len(self.names())

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Return the stored shape and dtype of ``name``.

        Args:
            name: A tensor's name.

        Returns:
            ``(shape, dtype)`` as stored.

        Raises:
            KeyError: When the checkpoint holds no tensor ``name``.
        """
        if self._state_dict is not None:
            if name not in self._state_dict:
                raise KeyError(f"{self.path}: no tensor named {name!r}")
            t = self._state_dict[name]
            return tuple(t.shape), t.dtype
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        entry = self._entries[name]
        return entry.shape, entry.dtype

    def location(self, name: str) -> TensorEntry | None:
        """Return where ``name``'s bytes lie in a safetensors checkpoint.

        Args:
            name: A tensor's name.

        Returns:
            Its entry (file, absolute byte range, dtype, shape); None for a torch.save checkpoint or a name it does
            not hold.
        """
        return None if self._state_dict is not None else self._entries.get(name)

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors as stored."""
        return sum(math.prod(shape) * element_size(dtype) for shape, dtype in map(self.shape_dtype, self.names()))

    def check(self, expected: Expected, strict: bool = True) -> KeyReport:
        """Compare the checkpoint with ``expected``.

        A shape that differs, or a dtype that cannot be converted (only floating point converts to floating point),
        is always an error; missing and unexpected names are errors when ``strict``, else returned.

        Args:
            expected: Name -> tensor, shape or (shape, dtype); a meta model's ``state_dict()`` will do.
            strict: Whether missing and unexpected names are errors.

        Returns:
            The missing and unexpected names (both empty when ``strict``, since any would have raised).

        Raises:
            CheckpointError: Listing every problem, when any.
        """
        return compare_keys(
            self.names(),
            self.shape_dtype,
            expected,
            strict,
            lambda problems, names: (
                f"{self.path} does not match the expected tensors: {problems}" + (NAMES_HINT if names else "")
            ),
        )

    # -- reading ----------------------------------------------------------------------------------------------
    def _target(self, name: str, stored: torch.dtype, dtype: DtypeSpec) -> torch.dtype:
        if dtype is None:
            return stored
        if isinstance(dtype, torch.dtype):  # like from_pretrained's torch_dtype: floating point tensors only
            return dtype if stored.is_floating_point and dtype.is_floating_point else stored
        target = dtype.get(name, stored)
        if not convertible(stored, target):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is stored as {stored}; converting it to {target} "
                f"would not be exact (only floating point converts to floating point)"
            )
        return target

    def _select(self, names: Iterable[str] | None) -> list[str]:
        if names is None:
            return self.names()
        wanted = list(dict.fromkeys(names))
        absent = [n for n in wanted if n not in self]
        if absent:
            raise CheckpointError(f"{self.path}: no tensors named {absent[:20]}")
        return wanted

    def iter_tensors(
        self, names: Iterable[str] | None = None, dtype: DtypeSpec = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for ``names``, in storage order, reading ahead.

        Each tensor is read once its turn comes; at most ``inflight_bytes`` are read ahead of the caller. A
        torch.save checkpoint's tensors are copied out of torch's copy-on-write mapping of the file (read from the
        page cache), converted where asked: what is yielded never depends on the file afterwards. A name the
        checkpoint lacks, a conversion that would not be exact, or a file changed since it was opened raises
        ``CheckpointError`` (a bad conversion before anything is read).

        Args:
            names: The tensors to read (default: all).
            dtype: One dtype for every floating point tensor, or name -> dtype (default: as stored).

        Yields:
            ``(name, tensor)`` pairs.
        """
        selected = self._select(names)
        for name in selected:  # refuse a bad conversion before reading anything
            self._target(name, self.shape_dtype(name)[1], dtype)
        if self._state_dict is not None:
            for name in selected:
                t = self._state_dict[name]
                target = self._target(name, t.dtype, dtype)
                check_unchanged(self._mapped_path, self._mapped_identity)
                copy = t.clone() if target == t.dtype else t.to(target)
                check_unchanged(self._mapped_path, self._mapped_identity)  # copied what was opened
                page_out(t)
                drop_cached(self._mapped_path)
                yield name, copy
            return
        yield from self._iter_safetensors(selected, dtype)

    def read(self, names: Iterable[str] | None = None, dtype: DtypeSpec = None) -> dict[str, torch.Tensor]:
        """Return ``{name: tensor}`` for ``names``, in storage order (see ``iter_tensors``).

        Args:
            names: The tensors to read (default: all).
            dtype: One dtype for every floating point tensor, or name -> dtype (default: as stored).

        Returns:
            The tensors by name.
        """
        return dict(self.iter_tensors(names, dtype))

    def _plan(self, selected: list[str], split: frozenset[str] = frozenset()) -> list[Span]:
        """Spans covering ``selected`` in storage order (see ``plan_spans``)."""
        order = {header.path: i for i, header in enumerate(self._headers)}
        entries = sorted((self._entries[n] for n in selected), key=lambda e: (order[e.path], e.start))
        return plan_spans(entries, self.span_bytes, self.gap_bytes, split)

    def _submit(self, span: Span, file_sizes: dict[str, int], pool: list[torch.Tensor] | None):
        """Start reading ``span``: (first byte read, its buffer, the request, the pooled buffer or None)."""
        start = span.start // READ_ALIGNMENT * READ_ALIGNMENT
        end = min(-(-span.end // READ_ALIGNMENT) * READ_ALIGNMENT, file_sizes[span.path])
        if end <= start:
            return start, None, None, None
        pooled = None
        if pool is not None and end - start <= self._pool_buffer_bytes:
            pooled = pool.pop() if pool else aligned_empty(self._pool_buffer_bytes, pin=False, prefault=True)
            buffer = pooled[: end - start]
        else:  # faulted in here, while earlier spans are read, rather than page by page inside the read
            buffer = aligned_empty(end - start, pin=False)
            began = time.perf_counter()
            fault_in(buffer, self._fault_threads)
            if end - start >= FAULT_SPLIT_PAGES * 2 * PAGE_BYTES:  # (small buffers time too coarsely to tell)
                slow = (end - start) / (time.perf_counter() - began) < SLOW_FAULT_BYTES_PER_S
                self._fault_threads = 2 if slow else 1
        return start, buffer, self.handle.read_async(buffer, span.path, start), pooled

    @property
    def _pool_buffer_bytes(self) -> int:
        return self.span_bytes + 2 * READ_ALIGNMENT  # a span of span_bytes, widened to the alignment at both ends

    def _spans(
        self, selected: list[str], pool: list[torch.Tensor] | None, split: frozenset[str] = frozenset()
    ) -> Iterator[tuple[Span, int, torch.Tensor | None]]:
        """Yield the spans covering ``selected``, each once its read is done, reading ahead up to ``inflight_bytes``.

        Args:
            selected: The tensors' names.
            pool: Buffers to read into; they go back to it once the caller resumes the generator (so the caller must
                be done with a buffer by then). None: new buffers.
            split: Tensors that may be read in pieces (see ``_plan``).

        Yields:
            ``(span, first byte read, buffer)``.
        """
        spans = self._plan(selected, split)
        file_sizes = {header.path: header.file_size for header in self._headers}
        identities = {header.path: header.identity for header in self._headers}
        queue: collections.deque = collections.deque()
        inflight, next_span = 0, 0
        try:
            while next_span < len(spans) or queue:
                while next_span < len(spans) and (
                    not queue or inflight + spans[next_span].end - spans[next_span].start <= self.inflight_bytes
                ):
                    span = spans[next_span]
                    check_unchanged(span.path, identities[span.path])
                    queue.append((span, *self._submit(span, file_sizes, pool)))
                    inflight += span.end - span.start
                    next_span += 1
                span, start, buffer, request, pooled = queue.popleft()
                if request is not None:
                    request.wait()
                    check_unchanged(span.path, identities[span.path])  # not replaced before the op opened it
                inflight -= span.end - span.start
                yield span, start, buffer
                if pooled is not None and pool is not None:  # (a pooled buffer came from pool)
                    pool.append(pooled)
        finally:  # the caller stopped early or a read failed: let reads in flight finish before their buffers go
            for _, _, _, request, _ in queue:
                if request is not None:
                    with contextlib.suppress(OSError):
                        request.wait()

    def _iter_safetensors(self, selected: list[str], dtype: DtypeSpec) -> Iterator[tuple[str, torch.Tensor]]:
        for span, start, buffer in self._spans(selected, None):
            for entry in span.entries:
                yield entry.name, self._tensor(entry, buffer, start, dtype)

    def read_into(self, destinations: Mapping[str, torch.Tensor]) -> None:
        """Copy each named checkpoint tensor into the tensor given for it, converting floating point dtypes.

        Shapes must be equal. Spans are read into buffers that this reader keeps and reuses from call to call
        (at most ``inflight_bytes`` plus one span of them), so loading block after block allocates no new memory;
        ``close()`` frees them. A contiguous destination larger than a span is filled piece by piece through those
        buffers (a non-contiguous one is read whole into new memory first).

        Args:
            destinations: Name -> materialized tensor to fill (e.g. a block's parameters).

        Raises:
            CheckpointError: Listing every problem (a meta or non-tensor destination, a name not in the checkpoint,
                a shape that differs, a dtype that cannot be converted exactly) before anything is read.
        """
        problems = []
        for name, tensor in destinations.items():
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                problems.append(f"{name}: the destination must be a materialized tensor")
            elif name not in self:
                problems.append(f"{name}: not in the checkpoint")
            else:
                shape, dtype = self.shape_dtype(name)
                if shape != tuple(tensor.shape):
                    problems.append(f"{name}: checkpoint {list(shape)}, destination {list(tensor.shape)}")
                elif not convertible(dtype, tensor.dtype):
                    problems.append(f"{name}: checkpoint {dtype} cannot become {tensor.dtype} exactly")
        if problems:
            raise CheckpointError(f"{self.path}: cannot read into the given tensors: " + "; ".join(problems[:20]))
        if self._state_dict is not None:
            check_unchanged(self._mapped_path, self._mapped_identity)
            for name, tensor in destinations.items():
                with torch.no_grad():
                    tensor.copy_(self._state_dict[name])
            check_unchanged(self._mapped_path, self._mapped_identity)
            for name in destinations:  # its pages leave the page cache (and this process's memory cgroup)
                page_out(self._state_dict[name])
            drop_cached(self._mapped_path)
            return
        split = frozenset(name for name, tensor in destinations.items() if tensor.is_contiguous())
        for span, start, buffer in self._spans(list(destinations), self._pool, split):
            for entry in span.entries:
                if entry.name not in destinations:
                    continue
                destination = destinations[entry.name]
                if span.piece is not None:  # the entry is elements [lo, hi) of the tensor, flattened
                    lo, hi = (bound // element_size(entry.dtype) for bound in span.piece)
                    destination = destination.view(-1)[lo:hi]
                with torch.no_grad():
                    destination.copy_(self._tensor(entry, buffer, start, None))

    def _tensor(self, entry: TensorEntry, buffer: torch.Tensor | None, start: int, dtype: DtypeSpec) -> torch.Tensor:
        target = self._target(entry.name, entry.dtype, dtype)
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=target)
        if buffer is None:  # only a span of empty tensors reads nothing: the header holds each entry in its file
            raise CheckpointError(f"{entry.path}: no bytes were read for {entry.name!r} ({entry.nbytes} bytes)")
        raw = buffer[entry.start - start : entry.end - start]
        if (entry.start - start) % element_size(entry.dtype):  # the format does not align tensors: copy to view
            raw = raw.clone()
        tensor = raw.view(entry.dtype).view(entry.shape)
        return tensor if target == entry.dtype else tensor.to(target)

    # -- lifetime ---------------------------------------------------------------------------------------------
    @property
    def handle(self) -> AsyncIOHandle:
        """The handle reads go through: the one passed in, else one made (and owned) on first use."""
        if self._handle is None:
            self._handle = AsyncIOHandle()
            self._own_handle = True
        return self._handle

    def close(self) -> None:
        """Close the handle this reader made (a handle passed in stays open) and free read_into's buffers.

        Reading again makes new ones.
        """
        if self._own_handle and self._handle is not None:
            self._handle.close()
        self._handle, self._own_handle = None, False
        self._pool = []

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, format={self.format!r}, tensors={len(self)})"
