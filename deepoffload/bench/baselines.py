"""What users would otherwise reach for, timed on the same file: Python's ``mmap`` and ``torch.save``/``load``.

Writes include reaching storage (``mmap.flush`` = msync, ``fsync`` after ``torch.save``); reads start with the file's
pages evicted from the page cache.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import torch

from .measure import Sample, evict

SLICE_BYTES = 1 << 20


def mmap_write(buffer: torch.Tensor, path: Path) -> Sample:
    """Copy ``buffer`` into a shared mapping of ``path`` in 1 MiB slices, then flush it to storage."""
    nbytes = buffer.numel()
    source = buffer.numpy().data  # memoryview(array)
    start = time.perf_counter()
    with open(path, "r+b") as f:
        if os.fstat(f.fileno()).st_size < nbytes:
            f.truncate(nbytes)
        with mmap.mmap(f.fileno(), nbytes) as mapping:
            for offset in range(0, nbytes, SLICE_BYTES):
                mapping[offset : offset + SLICE_BYTES] = source[offset : offset + SLICE_BYTES]
            mapping.flush()
    return Sample("mmap", "write", nbytes, time.perf_counter() - start, SLICE_BYTES)


def mmap_read(buffer: torch.Tensor, path: Path) -> Sample:
    """Copy the first ``buffer.numel()`` bytes of ``path`` into ``buffer`` through a mapping, in 1 MiB slices."""
    nbytes = buffer.numel()
    target = buffer.numpy().data  # memoryview(array)
    evict(path)
    start = time.perf_counter()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ) as mapping:
        with memoryview(mapping) as view:
            for offset in range(0, nbytes, SLICE_BYTES):
                target[offset : offset + SLICE_BYTES] = view[offset : offset + SLICE_BYTES]
    return Sample("mmap", "read", nbytes, time.perf_counter() - start, SLICE_BYTES)


def torch_save(buffer: torch.Tensor, path: Path) -> Sample:
    """``torch.save(buffer)`` to ``path`` followed by an fsync."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        try:
            torch.save(buffer, f)
        except RuntimeError as e:  # torch's zip writer, finalized after Ctrl-C, raises "enforce fail ... pos"
            if isinstance(e.__context__, KeyboardInterrupt):
                raise e.__context__ from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return Sample("torch.save", "write", buffer.numel(), time.perf_counter() - start, buffer.numel())


def torch_load(buffer: torch.Tensor, path: Path) -> Sample:
    """``torch.load(path)`` of a file written by ``torch_save`` (timed into a new tensor, as users do)."""
    evict(path)
    start = time.perf_counter()
    loaded = torch.load(path)
    seconds = time.perf_counter() - start
    del loaded
    return Sample("torch.load", "read", buffer.numel(), seconds, buffer.numel())
