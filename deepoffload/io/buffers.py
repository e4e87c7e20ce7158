"""Aligned, page-locked host buffers: the memory that takes the async-IO op's fast path (no bounce copy).

``aligned_empty`` maps anonymous memory (page-aligned by construction), locks it with ``mlock`` where
``RLIMIT_MEMLOCK`` allows (warning once and carrying on unlocked where it does not), registers it with the
accelerator when it can register memory it did not allocate, and wraps it in a tensor. The mapping, its lock and its
registration live exactly as long as the tensor (and any view of it). Buffers of 2 MiB or more start on a 2 MiB
boundary and ask for transparent huge pages. An accelerator that cannot register such memory
(see ``accelerator``) gets a slice of torch's pinned host memory for it instead; one that cannot page-lock at all gets
the mapping unregistered (warned once).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import operator
import os
import sys
import threading
import warnings
import weakref
from typing import Sequence, SupportsIndex, cast

import torch

from . import accelerator

PAGE_SIZE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault every page of a range in for writing
MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the pages of a range now (clean file pages leave the page cache)
HUGE_PAGE = 2 << 20  # buffers at least this large start on this boundary and ask for transparent huge pages

if sys.platform != "win32":  # (os.name == "posix"; mypy checks only the branch for the platform it runs on)
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _kernel32 = None
else:
    _libc = None
    _kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
_locked_lock = threading.Lock()
_locked: dict[int, int] = {}  # start address -> bytes, for is_pinned()
_warned_memlock = False


def _numel(shape_or_numel: int | Sequence[int]) -> tuple[int, tuple[int, ...]]:
    def dim(s: object) -> int:
        if isinstance(s, bool) or not hasattr(type(s), "__index__"):
            raise TypeError(
                f"aligned_empty: expected a size (int) or a shape (sequence of ints), got {shape_or_numel!r}"
            )
        return operator.index(cast(SupportsIndex, s))  # its type has __index__: checked above

    if isinstance(shape_or_numel, (str, bytes)) or not isinstance(shape_or_numel, Sequence):
        shape: tuple[int, ...] = (dim(shape_or_numel),)
    else:
        shape = tuple(dim(s) for s in shape_or_numel)
    if any(s < 0 for s in shape):
        raise ValueError(f"aligned_empty: negative dimension in shape {shape}")
    return math.prod(shape), shape


def _lock_pages(address: int, nbytes: int) -> bool:
    """mlock (POSIX) or VirtualLock (Windows); warns once and returns False where the limit refuses."""
    global _warned_memlock
    if _libc is not None:
        if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0:
            return True
        reason = (
            f"{os.strerror(ctypes.get_errno())}; RLIMIT_MEMLOCK is probably too small (raise it with "
            f"`ulimit -l unlimited` or in limits.conf)"
        )
    else:
        if _kernel32.VirtualLock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)):
            return True
        reason = (
            f"Windows error {ctypes.get_last_error()}; the process working-set quota is probably too "
            f"small (SetProcessWorkingSetSize)"
        )
    if not _warned_memlock:
        _warned_memlock = True
        warnings.warn(
            f"deepoffload: cannot page-lock {nbytes} bytes ({reason}); using unlocked buffers, which "
            f"still work but may be slower",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def _unlock_pages(address: int, nbytes: int) -> None:
    if _libc is not None:
        _libc.munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))
    else:
        _kernel32.VirtualUnlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))


def _release(address: int, nbytes: int, locked: bool, registered_with: accelerator.Accelerator | None) -> None:
    with _locked_lock:
        _locked.pop(address, None)
    if registered_with is not None:
        registered_with.unregister_host(address)
    if locked:
        _unlock_pages(address, nbytes)


def _advise_huge_pages(region: mmap.mmap) -> None:
    """Ask for transparent huge pages (where the kernel offers them; ordinary pages otherwise).

    Filling a buffer then takes one page fault per 2 MiB instead of per 4 KiB, and the kernel pins its pages for
    direct IO in far fewer steps: measured here, O_DIRECT reads into fresh memory 2-3x faster, into locked memory
    about 1.25x.
    """
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # transparent huge pages disabled or unsupported: ordinary pages


def _prefault(start: int, nbytes: int) -> None:
    """Back [start, start + nbytes) with memory now, from this thread.

    Uses ``MADV_POPULATE_WRITE`` (Linux 5.14+), else writes a byte of every page.
    """
    if _libc is not None and _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes), MADV_POPULATE_WRITE) == 0:
        return
    pages = (ctypes.c_char * nbytes).from_address(start)
    for offset in range(0, nbytes, PAGE_SIZE):
        pages[offset] = b"\0"


def prefault(tensor: torch.Tensor) -> None:
    """Back every page of a CPU tensor's memory now, from this thread.

    A direct read into it then takes no page faults inside the kernel (a read that faults its pages in as it goes is
    several times slower).

    Args:
        tensor: A CPU tensor (its pages are written to where ``MADV_POPULATE_WRITE`` is missing: only for memory
            whose values do not matter yet).
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes:
        start = tensor.data_ptr() - tensor.data_ptr() % PAGE_SIZE
        _prefault(start, (tensor.data_ptr() + nbytes - start + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE)


def aligned_empty(
    shape_or_numel: int | Sequence[int],
    dtype: torch.dtype = torch.uint8,
    alignment: int = 0,
    pin: bool = True,
    prefault: bool = False,
) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on an ``alignment``-byte boundary: the async-IO op's fast path.

    For memory this maps, its storage starts there too. The memory is returned to the system (or, for memory from
    torch's pinned allocator, to torch's host cache) when the tensor and all its views are gone.

    Args:
        shape_or_numel: The number of elements (a 1-D tensor), or the shape.
        dtype: The element type.
        alignment: The boundary in bytes, a power of two (0 = the page size).
        pin: Lock the pages in memory where the memlock limit allows (warning once where it does not), and
            page-lock them for the current accelerator when there is one.
        prefault: Back every page with memory before this returns (implied by a successful lock), so that a direct
            read into the buffer takes no page faults.

    Returns:
        The tensor, of ``dtype`` and the given shape (contents uninitialised).

    Raises:
        ValueError: When ``alignment`` is not a power of two, or the shape has a negative dimension
            (``TypeError`` when ``shape_or_numel`` is neither an int nor a sequence of ints).

    Examples:
        >>> import torch, deepoffload
        >>> buffer = deepoffload.aligned_empty((2, 1024), torch.float32)
        >>> buffer.shape, buffer.dtype
        (torch.Size([2, 1024]), torch.float32)
        >>> deepoffload.is_aligned(buffer)
        True
        >>> deepoffload.aligned_empty(4096, alignment=4096, pin=False).shape
        torch.Size([4096])
    """
    numel, shape = _numel(shape_or_numel)
    alignment = alignment or PAGE_SIZE
    if alignment & (alignment - 1):
        raise ValueError(f"aligned_empty: alignment must be a power of two, got {alignment}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    acc = accelerator.current()
    if pin and acc.device_type is not None and not acc.can_register_host():
        pinned = acc.pinned_empty(nbytes + alignment)  # None (warned once): the mapping below, unregistered
        if pinned is not None:
            skip = (-pinned.data_ptr()) % alignment
            return pinned[skip : skip + nbytes].view(dtype).view(shape)
    huge = os.name == "posix" and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    if huge:
        alignment = max(alignment, HUGE_PAGE)
    extra = alignment - PAGE_SIZE if alignment > PAGE_SIZE else 0
    length = (nbytes + extra + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
    if os.name == "posix":
        region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            _advise_huge_pages(region)
    else:  # an anonymous mapping backed by the paging file, 64 KiB-aligned
        region = mmap.mmap(-1, length)
    skip = (-torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()) % alignment
    data = torch.frombuffer(region, dtype=torch.uint8, offset=skip, count=nbytes)  # its storage starts there too
    start, used = data.data_ptr(), (nbytes + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE  # what is locked
    locked = pin and _lock_pages(start, used)
    if prefault and not locked:
        _prefault(start, used)
    registered = pin and acc.can_register_host() and acc.register_host(start, used)
    with _locked_lock:
        if locked or registered:
            _locked[start] = used
    weakref.finalize(region, _release, start, used, locked, acc if registered else None)
    return data.view(dtype).view(shape)


def page_out(tensor: torch.Tensor) -> None:
    """Ask the kernel to reclaim the pages holding a CPU tensor mapped from a file (``MADV_PAGEOUT``).

    Nothing happens where the system lacks it. A file read through ``mmap`` otherwise stays in the page cache, which
    counts towards the process's memory cgroup, up to the file's size. Clean file pages are read again if touched
    later, so the values never change.

    Args:
        tensor: A CPU tensor of memory mapped from a file and never written through the mapping.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if _libc is None or not nbytes:
        return
    start = tensor.data_ptr() - tensor.data_ptr() % PAGE_SIZE
    length = (tensor.data_ptr() + nbytes - start + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_PAGEOUT)  # advice: failure changes nothing


def drop_cached(path: str | os.PathLike) -> None:
    """Drop the file's clean pages that no process maps from the page cache (``POSIX_FADV_DONTNEED``).

    Nothing happens where the system lacks it or the file cannot be opened. What the kernel read ahead around a
    mapped file's pages otherwise stays cached, charged to this process's memory cgroup. Other readers of the file
    read it from storage again.

    Args:
        path: The file.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # advice only: the read that follows reports a missing file
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def release_lock(address: int, nbytes: int) -> None:
    """Unlock the pages of an ``aligned_empty`` buffer early.

    The memory stays valid while the tensor lives, but ``is_pinned`` no longer reports it. Nothing happens for memory
    this module did not lock.

    Args:
        address: The buffer's start address (its page is looked up).
        nbytes: The buffer's size in bytes (the length locked, as recorded, is what is unlocked).
    """
    with _locked_lock:
        length = _locked.pop(address - address % PAGE_SIZE, None)
    if length is not None:
        _unlock_pages(address - address % PAGE_SIZE, length)


def is_aligned(tensor: torch.Tensor, alignment: int = 0) -> bool:
    """Whether the tensor's data starts on an ``alignment``-byte boundary.

    Args:
        tensor: Any tensor (its ``data_ptr()`` is tested).
        alignment: The boundary in bytes (0 = the page size).

    Returns:
        True when the data starts on the boundary.

    Examples:
        >>> import torch, deepoffload
        >>> buffer = deepoffload.aligned_empty(1024, torch.float32)
        >>> deepoffload.is_aligned(buffer), deepoffload.is_aligned(buffer[1:]), deepoffload.is_aligned(buffer[1:], 4)
        (True, False, True)
    """
    return tensor.data_ptr() % (alignment or PAGE_SIZE) == 0


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory is page-locked (by ``aligned_empty`` or by torch's pinned allocator).

    A buffer of ``aligned_empty(..., pin=True)`` is, where the memlock limit allowed the lock (or the accelerator
    registered it).

    Args:
        tensor: Any tensor (False for one that is not on the CPU).

    Returns:
        True when its memory is page-locked.

    Examples:
        >>> import torch, deepoffload
        >>> deepoffload.is_pinned(torch.empty(16))
        False
        >>> deepoffload.is_pinned(deepoffload.aligned_empty(4096, pin=False))
        False
    """
    if tensor.device.type != "cpu":
        return False
    ptr = tensor.data_ptr()
    with _locked_lock:
        for start, length in _locked.items():
            if start <= ptr < start + length:
                return True
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:  # torch without an accelerator backend cannot pin: only our own locked memory can be
        return False
