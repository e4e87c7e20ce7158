"""``ByteStream``: one append-only file of a cache layer's keys (or values), its unwritten tail in memory.

The file holds the layer's rows, token after token (token-major: ``[tokens, batch, heads, head_dim]``), as bytes.
Appended bytes go to an in-memory tail; once the tail holds ``flush_bytes`` or more, its largest whole-page prefix is
written (one asynchronous write at the file's end, from a page-aligned buffer of its own) and the rest stays in the
tail. So the file is always a whole number of pages, every write and read is page-aligned (O_DIRECT), and at most
one write per stream is in flight; the write goes from the tail's own buffer (no copy), which it holds until settled.
In memory per stream: the tail (under ``flush_bytes`` plus the last append) and the write in flight. A read of the
stream is one read of the whole file plus a copy of the tail, into a buffer of the cache's ``ReadBuffers`` (reused
once nothing refers to it any more, with spare room for the next tokens, so that a decoded token's keys and values
go after the stored ones in place: no fresh memory and no second copy per token).

A failed write (a full disk) puts its bytes back in front of the tail and stops further writes: every byte stays in
memory, exact, and the error (errno, path, offset) waits in ``error`` until the owner reports it.
"""

from __future__ import annotations

import torch

from ..io.buffers import aligned_empty
from ..io.handle import AsyncIOHandle
from ..io.request import Request
from ..swap.pool import round_up


def _use_count(buffer: torch.Tensor) -> int:
    """How many tensors (views included) refer to ``buffer``'s memory."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)


class ReadBuffers:
    """Page-aligned buffers the reads of a cache's streams go into, reused once nothing else refers to them.

    A buffer is free when only the pool refers to its memory (its views, handed to the model as keys and values or
    held by a read in flight, are gone): a tensor kept by a caller is never overwritten. Each buffer has room for
    ``SPARE`` more of its bytes (a decoded token's rows go after the stored ones); too small free buffers are
    dropped, and the pool keeps at most ``limit`` buffers.

    Args:
        limit: The most buffers kept.
    """

    SPARE = 8  # room for 1/SPARE more bytes

    def __init__(self, limit: int):
        self.limit = limit
        self.buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, its use count when free)
        self.allocated = 0  # bytes allocated (fresh memory) since the pool was made

    def take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least ``nbytes`` (reused, or new).

        Args:
            nbytes: The bytes needed.

        Returns:
            A page-aligned uint8 buffer, referred to by nothing else.
        """
        free = [i for i, (buffer, count) in enumerate(self.buffers) if _use_count(buffer) == count]
        for i in free:
            if self.buffers[i][0].numel() >= nbytes:
                return self.buffers[i][0]
        for i in reversed(free):  # free but too small: let them go
            del self.buffers[i]
        size = round_up(max(nbytes + nbytes // self.SPARE, 1))
        buffer = aligned_empty(size, pin=False)
        self.allocated += size
        self.buffers.append((buffer, _use_count(buffer)))
        if len(self.buffers) > self.limit:
            del self.buffers[0]  # the oldest: still used by someone, or it would have been taken
        return buffer


class StreamRead:
    """A read of a stream in flight: the whole file into ``buffer``, the tail already copied after it.

    Attributes:
        request: The file's read (None when the file is empty). buffer: page-aligned bytes, at least ``nbytes``.
        nbytes: The stream's bytes at the read (file plus tail).
    """

    __slots__ = ("request", "buffer", "nbytes")

    def __init__(self, request: Request | None, buffer: torch.Tensor, nbytes: int):
        self.request = request
        self.buffer = buffer
        self.nbytes = nbytes

    def wait(self) -> tuple[torch.Tensor, int]:
        """Wait for the read.

        Returns:
            The stream's bytes (a uint8 tensor of ``nbytes``) and the bytes that came from the file.

        Raises:
            OSError: When the read fails (errno, path, offset).
        """
        done = 0 if self.request is None else self.request.wait()
        return self.buffer[: self.nbytes], done


class ByteStream:
    """One append-only file and its in-memory tail.

    Args:
        handle: The async-IO handle of the cache.
        path: The file (created by the owner, empty).
        flush_bytes: Write the tail once it holds this many bytes (rounded up to whole pages).
    """

    def __init__(self, handle: AsyncIOHandle, path: str, flush_bytes: int):
        self.handle = handle
        self.path = path
        self.flush_bytes = round_up(max(flush_bytes, 1))
        self.flushed = 0  # bytes on the file (whole pages), counting a write in flight
        self.tail = aligned_empty(round_up(1), pin=False)  # page-aligned: its whole pages are written from it
        self.tail_bytes = 0
        self.writing: tuple[Request, torch.Tensor, int] | None = None  # (request, buffer, offset)
        self.error: OSError | None = None  # the failed write, until the owner takes it
        self.stopped = False  # after a failed write: nothing more is written
        self.bytes_written = 0
        self.bytes_read = 0

    @property
    def nbytes(self) -> int:
        """The stream's bytes (on the file and in the tail)."""
        return self.flushed + self.tail_bytes

    def append(self, data: torch.Tensor) -> None:
        """Append ``data``'s bytes (a contiguous uint8 CPU tensor); write the tail when it is full enough.

        Args:
            data: The bytes.
        """
        self._put_tail(data, at_front=False)
        if not self.stopped and self.tail_bytes >= self.flush_bytes:
            self._flush()

    def _put_tail(self, data: torch.Tensor, at_front: bool) -> None:
        n = data.numel()
        needed = self.tail_bytes + n
        if needed > self.tail.numel() or at_front:
            # grow by doubling up to flush_bytes (decode appends a token at a time), never beyond what is needed
            grown = aligned_empty(round_up(max(needed, min(2 * self.tail.numel(), self.flush_bytes))), pin=False)
            start = n if at_front else 0
            grown[start : start + self.tail_bytes].copy_(self.tail[: self.tail_bytes])
            self.tail = grown
        if at_front:
            self.tail[:n].copy_(data)
        else:
            self.tail[self.tail_bytes : needed].copy_(data)
        self.tail_bytes = needed

    def _flush(self) -> None:
        """Write the tail's whole pages from the tail itself (it goes with the write); the rest starts a new tail."""
        self.settle()
        if self.stopped:
            return
        nbytes = self.tail_bytes - self.tail_bytes % round_up(1)
        if nbytes == 0:
            return
        written, rest = self.tail, self.tail_bytes - nbytes
        self.tail = aligned_empty(round_up(max(rest, 1)), pin=False)
        self.tail[:rest].copy_(written[nbytes : self.tail_bytes])
        self.tail_bytes = rest
        request = self.handle.write_async(written[:nbytes], self.path, self.flushed, truncate=False)
        self.writing = (request, written[:nbytes], self.flushed)
        self.flushed += nbytes

    def settle(self) -> None:
        """Wait for the write in flight; a failed one puts its bytes back in the tail and stops writing."""
        if self.writing is None:
            return
        request, buffer, offset = self.writing
        self.writing = None
        try:
            self.bytes_written += request.wait()
        except OSError as e:
            self.flushed = offset
            self._put_tail(buffer, at_front=True)
            self.stopped = True
            self.error = OSError(
                e.errno,
                f"StorageCache: writing {buffer.numel()} bytes of keys or values to {self.path} at offset {offset} "
                f"failed ({e}); they stay in memory, and so does every later token of this cache",
                self.path,
            )

    def start_read(self, buffers: ReadBuffers) -> StreamRead:
        """Start reading the whole stream (after its write in flight has completed).

        Args:
            buffers: Where the read's buffer comes from.

        Returns:
            The read; its buffer already holds the tail's bytes after the file's.
        """
        self.settle()
        total = self.nbytes
        buffer = buffers.take(max(round_up(total), round_up(1)))[:]  # a view: the buffer is in use while it lives
        request = None
        if self.flushed:
            request = self.handle.read_async(buffer[: self.flushed], self.path, 0)
            self.bytes_read += self.flushed
        buffer[self.flushed : total].copy_(self.tail[: self.tail_bytes])
        return StreamRead(request, buffer, total)

    def take_error(self) -> OSError | None:
        """The failed write's error, once.

        Returns:
            The ``OSError`` (errno, path and offset in it), or None.
        """
        error, self.error = self.error, None
        return error

    def reset(self) -> None:
        """Forget every byte (the file's old bytes are overwritten by later writes, never read)."""
        self.settle()
        self.error = None
        self.flushed = 0
        self.tail = aligned_empty(round_up(1), pin=False)
        self.tail_bytes = 0
