"""A bounded pool of page-aligned (optionally page-locked) staging buffers of one size.

Buffers are made on first use, at most ``count`` of them, each ``buffer_bytes`` bytes. A request larger than that
gets a one-off buffer that is freed when released, so the pool itself never grows past ``count * buffer_bytes``;
``fit`` raises ``buffer_bytes`` for a user whose requests are larger every time (a reused buffer's pages are faulted
in already: O_DIRECT reads into fresh 4 KiB pages ran at 0.4-1.0 GB/s here, into faulted-in ones 2.3 GB/s).
The pool owns its buffers; whoever acquires one owns it until ``release`` (or ``forget``, when views of it must
outlive their use, e.g. tensors left resident after a failed write).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

import torch

from ..io.buffers import PAGE_SIZE, aligned_empty


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim`` from this process, or None (another C library, or not POSIX)."""
    if os.name != "posix":
        return None
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:  # this process's symbols cannot be opened: no trimming (documented)
        return None


def trim_heap() -> None:
    """Give the pages of freed heap memory back to the system (glibc's ``malloc_trim(0)``; elsewhere nothing).

    glibc raises its mmap threshold each time a large block is freed, so large tensors freed later (e.g. state the
    optimizer created in memory, then stored) stay in the heap as free memory the process keeps; this returns it.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (``/proc/self/statm``), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):  # no /proc here: the caller trims by bytes let go instead
        return None


class GrowthTrim:
    """Trims the heap (``trim_heap``) only when the process's resident memory grew ``trim_bytes`` since the last trim.

    Large tensors freed after glibc raised its mmap threshold stay in the heap as free memory the process keeps. A
    trim costs twice: its own walk, and the page faults (and zeroing) when the heap grows into the returned pages
    again. So freed memory the next tensors reuse is never returned: the resident memory is looked at every
    ``check_bytes`` let go, and the heap trimmed once it is ``trim_bytes`` above where it was after the last trim (or
    lower since). Where the resident memory cannot be read, the heap is trimmed every ``trim_bytes`` let go.
    """

    def __init__(self, trim_bytes: int, check_bytes: int):
        self.trim_bytes, self.check_bytes = trim_bytes, check_bytes
        self._released = 0
        self._resident_low = resident_bytes()  # the resident memory after the last trim, or lower since

    def released(self, nbytes: int) -> None:
        """``nbytes`` of tensors were let go: trim the heap if the resident memory grew ``trim_bytes``.

        Args:
            nbytes: The bytes let go.
        """
        self._released += nbytes
        if self._released < (self.check_bytes if self._resident_low is not None else self.trim_bytes):
            return
        self._released = 0
        resident = resident_bytes()
        if resident is None or self._resident_low is None:
            trim_heap()
            return
        if resident - self._resident_low >= self.trim_bytes:
            trim_heap()
            self._resident_low = resident_bytes() or resident
        else:
            self._resident_low = min(self._resident_low, resident)


def round_up(nbytes: int, alignment: int = PAGE_SIZE) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment`` (bytes)."""
    return (nbytes + alignment - 1) // alignment * alignment


class BufferPool:
    """``count`` reusable uint8 buffers of ``buffer_bytes`` bytes (rounded up to the page size)."""

    def __init__(self, count: int, buffer_bytes: int, pin: bool = True):
        self.count = count
        self.buffer_bytes = round_up(buffer_bytes)
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._pooled: dict[int, int] = {}  # data_ptr -> bytes of every pooled buffer, free or in use

    def try_acquire(self, nbytes: int, prefer: torch.Tensor | None = None) -> torch.Tensor | None:
        """A buffer of at least ``nbytes`` bytes, if one is free.

        Args:
            nbytes: The bytes needed.
            prefer: The buffer to hand out when it is a free pooled buffer.

        Returns:
            A buffer (``prefer`` when it is free), or None when all pooled buffers are in use. Larger requests than
            ``buffer_bytes`` always succeed with a one-off buffer.
        """
        if nbytes > self.buffer_bytes:
            return self.one_off(nbytes)
        if prefer is not None:
            for i, buffer in enumerate(self._free):
                if buffer is prefer:
                    return self._free.pop(i)
        if self._free:
            return self._free.pop()
        if len(self._pooled) < self.count:
            buffer = self._allocate(self.buffer_bytes)
            self._pooled[buffer.data_ptr()] = self.buffer_bytes
            return buffer
        return None

    def available(self) -> bool:
        """True when ``try_acquire`` of at most ``buffer_bytes`` would return a buffer now."""
        return bool(self._free) or len(self._pooled) < self.count

    def one_off(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes outside the pool, freed when released."""
        return self._allocate(round_up(nbytes))

    def _allocate(self, nbytes: int) -> torch.Tensor:
        try:
            return aligned_empty(nbytes, pin=self.pin)
        except (OSError, MemoryError) as e:
            if isinstance(e, OSError) and e.errno != errno.ENOMEM:
                raise  # e.g. a page-locking failure, whose own message says what to do
            raise OSError(
                errno.ENOMEM,
                f"cannot allocate a {nbytes}-byte swap staging buffer (up to {self.count} of them, each "
                f"SwapConfig.chunk_bytes or the largest tensor swapped; offload_parameters sizes them from its "
                f"blocks): lower SwapConfig(chunk_bytes=, buffer_count=) (OffloadedOptimizer, TensorSwapper), "
                f"stream smaller blocks (offload_parameters(blocks=...)), or free memory",
            ) from e

    def fit(self, nbytes: int) -> None:
        """Pooled buffers hold at least ``nbytes`` (rounded up to the page size) from now on; never shrinks.

        Smaller free ones are freed now, smaller ones in use when released; new ones are made at the new size.
        """
        nbytes = round_up(nbytes)
        if nbytes <= self.buffer_bytes:
            return
        self.buffer_bytes = nbytes
        for buffer in self._free:
            self._pooled.pop(buffer.data_ptr(), None)
        self._free = []

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer back; no view of it may be used afterwards.

        One-off buffers (and pooled ones smaller than ``buffer_bytes`` since ``fit``) are freed.
        """
        nbytes = self._pooled.get(buffer.data_ptr())
        if nbytes is not None and nbytes < self.buffer_bytes:
            del self._pooled[buffer.data_ptr()]
        elif nbytes is not None:
            self._free.append(buffer)

    def forget(self, buffer: torch.Tensor) -> None:
        """Stop pooling ``buffer`` (its views live on and free it when they die); a new one replaces it."""
        self._pooled.pop(buffer.data_ptr(), None)

    def pooled(self, buffer: torch.Tensor | None) -> bool:
        """True when ``buffer`` is one of the pool's buffers (not a one-off, not forgotten)."""
        return buffer is not None and buffer.data_ptr() in self._pooled

    def held_bytes(self) -> int:
        """Bytes of pooled buffers made so far (free or in use)."""
        return sum(self._pooled.values())
