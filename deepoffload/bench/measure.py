"""Timed transfers through ``AsyncIOHandle`` and the test file they use.

A ``Sample`` is one timed transfer of a whole file. Throughput is in GB/s (1e9 bytes per second). Reads measure the
storage, not the page cache: the op uses O_DIRECT where the filesystem accepts it, and the file's cached pages are
evicted (fsync, then ``posix_fadvise(DONTNEED)``) before every read in any case.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..config import AioConfig
from ..errors import BenchError
from ..io.buffers import aligned_empty
from ..io.handle import AsyncIOHandle

BUFFER_KINDS = ("pinned", "unaligned")
OPS = ("write", "read")


@dataclass(frozen=True)
class Sample:
    """One timed transfer: ``nbytes`` moved by ``tool`` in ``seconds``, split into requests of ``block_size`` bytes.

    Attributes:
        tool: What moved the bytes (``deepoffload``, ``fio``, ...).
        op: ``read`` or ``write``.
        nbytes: The bytes moved.
        seconds: How long the transfer took.
        block_size: The request size in bytes.
    """

    tool: str
    op: str
    nbytes: int
    seconds: float
    block_size: int

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9

    @property
    def requests(self) -> int:
        """Block-sized requests the transfer was split into."""
        return max(1, math.ceil(self.nbytes / self.block_size))

    @property
    def seconds_per_request(self) -> float:
        """Transfer time divided by the number of block requests (with a queue, not one request's latency)."""
        return self.seconds / self.requests


def make_buffer(nbytes: int, kind: str) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` bytes, filled with a random (incompressible) pattern.

    Args:
        nbytes: The buffer's size in bytes.
        kind: ``pinned``: page-aligned and page-locked (the zero-copy path); ``unaligned``: starts one byte past a
            torch allocation (the bounce-buffer path).

    Returns:
        The buffer.

    Raises:
        ValueError: When ``kind`` is not one of ``BUFFER_KINDS``.
        BenchError: When memory cannot hold it.
    """
    if kind not in BUFFER_KINDS:
        raise ValueError(f"buffer kind must be one of {', '.join(BUFFER_KINDS)}, got {kind!r}")
    available = available_memory()
    too_big = (
        f"the {nbytes}-byte test buffer (--size: one transfer is the whole file, held in memory) does not fit in memory"
    )
    if available is not None and nbytes > available:
        raise BenchError(f"{too_big}: {available} bytes are available; pass a smaller --size")
    try:
        buffer = aligned_empty(nbytes) if kind == "pinned" else torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    except (MemoryError, RuntimeError, OSError) as e:  # torch says "DefaultCPUAllocator: can't allocate memory"
        raise BenchError(f"{too_big} ({e}); pass a smaller --size") from e
    pattern = torch.randint(
        0, 256, (min(nbytes, 1 << 20),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    for offset in range(0, nbytes, pattern.numel()):
        chunk = buffer[offset : offset + pattern.numel()]
        chunk.copy_(pattern[: chunk.numel()])
    return buffer


def available_memory() -> int | None:
    """Bytes of memory the kernel says can be allocated without swapping (``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # no /proc or an unexpected line: unknown, as documented
        pass
    return None


def evict(path: Path) -> None:
    """Write back and drop ``path``'s pages from the page cache, so the next buffered read comes from storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def scratch_file(folder: str | os.PathLike, nbytes: int, spare: int = 0) -> Iterator[Path]:
    """A new, empty file in ``folder`` for a test of ``nbytes`` bytes, removed on exit whatever happens.

    Args:
        folder: The folder on the storage to measure.
        nbytes: The bytes the test writes.
        spare: Bytes of headroom the free space must also have.

    Yields:
        The file's path.

    Raises:
        BenchError: When the folder is missing, not writable or has too little free space.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise BenchError(f"{folder} is not an existing folder; pass --path a folder on the storage to measure")
    path = folder / f".deepoffload-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    try:  # first: a folder that takes no files (/proc, read-only) is that, not "full"
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        virtual = " (a virtual filesystem with no storage behind it)" if shutil.disk_usage(folder).total == 0 else ""
        raise BenchError(
            f"cannot create a test file in {folder}{virtual}: {e.strerror}; pass --path a folder on "
            f"the storage you can write to"
        ) from e
    try:
        free = shutil.disk_usage(folder).free
        if free < nbytes + spare:
            raise BenchError(
                f"not enough free space in {folder}: the test file needs {nbytes + spare} bytes, "
                f"{free} are free; pass a smaller --size or another --path"
            )
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def time_transfer(handle: AsyncIOHandle, op: str, buffer: torch.Tensor, path: Path, direct: bool) -> Sample:
    """Move ``buffer`` to (``write``) or from (``read``) the start of ``path`` once and time it.

    Writes overwrite in place (no truncation, like fio) and, when the file is not on O_DIRECT, are fsynced so the
    time includes reaching storage. Before a read the file's cached pages are evicted (not timed).

    Args:
        handle: The handle that moves the bytes.
        op: ``read`` or ``write``.
        buffer: The bytes to write, or the tensor to read into.
        path: The test file.
        direct: Whether the file is on O_DIRECT (else writes are fsynced).

    Returns:
        The transfer, with tool ``deepoffload`` and the handle's block size.

    Raises:
        ValueError: When ``op`` is neither ``read`` nor ``write``.
    """
    if op == "write":
        start = time.perf_counter()
        handle.write(buffer, path, truncate=False, fsync=not direct)
    elif op == "read":
        evict(path)
        start = time.perf_counter()
        handle.read(buffer, path)
    else:
        raise ValueError(f"op must be 'read' or 'write', got {op!r}")
    seconds = time.perf_counter() - start
    return Sample("deepoffload", op, buffer.numel(), seconds, handle.block_size)


def round_trip(config: AioConfig, buffer: torch.Tensor, path: Path, direct: bool) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one write and one read of ``buffer`` at the start of ``path``.

    The transfers use a new handle made from ``config``; its start-up and shutdown are not timed.

    Args:
        config: The handle's settings.
        buffer: The bytes to write and read back.
        path: The test file.
        direct: Whether the file is on O_DIRECT (else writes are fsynced).

    Returns:
        The write and the read throughput in GB/s.
    """
    with AsyncIOHandle(config) as handle:
        write = time_transfer(handle, "write", buffer, path, direct)
        read = time_transfer(handle, "read", buffer, path, direct)
    return write.gbps, read.gbps
