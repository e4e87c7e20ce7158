"""File-like streams whose bytes move through the async-IO op: what ``torch.save``/``torch.load`` (and DCP's
filesystem storage) write to and read from.

``DirectWriter`` copies whatever it is given into page-aligned, page-locked staging buffers and writes each full
buffer with one large aligned (O_DIRECT where the filesystem allows) write while the next buffer fills: serialization
and IO overlap. ``DirectReader`` reads each large request straight into the caller's memory through the op (the
op's aligned bounce buffers handle any unaligned head and tail) and serves small ones (zip headers, pickles) with
ordinary reads.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import threading
import warnings
from typing import Callable

import torch

from ..config import AioConfig
from ..io.buffers import aligned_empty
from ..io.handle import AsyncIOHandle, Request

STAGING_BYTES = 32 << 20  # per staging buffer; a multiple of every O_DIRECT alignment
STAGING_BUFFERS = 2  # double buffering: one fills while the other is written
DIRECT_READ_MIN = 256 << 10  # reads this large go through the op; smaller ones are plain preads
READ_AHEAD = 4  # read-ahead chunks in flight

_handles: dict[AioConfig, AsyncIOHandle] = {}
_handles_lock = threading.Lock()
_pool: list[torch.Tensor] = []  # idle staging buffers, reused across writers
_pool_lock = threading.Lock()
POOL_MAX = STAGING_BUFFERS + 4  # enough for one writer and one reader at a time


def shared_handle(config: AioConfig | None = None) -> AsyncIOHandle:
    """One handle per config for all checkpoint IO of this process (handles are thread-safe)."""
    config = config or AioConfig.from_env()
    with _handles_lock:
        handle = _handles.get(config)
        if handle is None or handle._closed:
            handle = _handles[config] = AsyncIOHandle(config)
        return handle


def _take_staging() -> torch.Tensor:
    """A staging buffer of ``STAGING_BYTES`` (read-ahead chunks use the same size)."""
    with _pool_lock:
        while _pool:
            buffer = _pool.pop()
            if buffer.nbytes == STAGING_BYTES:
                return buffer
    return aligned_empty(STAGING_BYTES)


def _give_staging(buffer: torch.Tensor) -> None:
    with _pool_lock:
        if len(_pool) < POOL_MAX:
            _pool.append(buffer)


def address_of(view: memoryview) -> int:
    """The address of a contiguous memoryview's first byte (read-only views too)."""
    if view.nbytes == 0:
        return 0
    with warnings.catch_warnings():  # torch warns that a read-only buffer is not writable; only its address is used
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


class DirectWriter(io.RawIOBase):
    """A write-only stream into ``path`` (created or truncated) through the async-IO op.

    Writes are sequential. Each full staging buffer is written asynchronously at its file offset; ``close()`` writes
    the tail, waits for everything, and with ``sync`` fsyncs the file. ``flush()`` does nothing (bytes reach the file
    at the latest on ``close()``); ``fileno()`` first writes out everything buffered, so an ``os.fsync(fileno())``
    before ``close()`` (what DCP's writer does) covers every byte written so far.

    After a write fails, later writes are accepted and dropped (torch's zip writer aborts the process if its sink
    raises and it is then finalized), and ``close()`` raises the first error; ``error`` holds it meanwhile.
    """

    def __init__(self, path: str | os.PathLike, *, config: AioConfig | None = None, sync: bool = True):
        super().__init__()
        self.path = os.fspath(path)
        self.sync = sync
        self.error: OSError | None = None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        self._handle = shared_handle(config)
        self._staging: list[torch.Tensor] = []
        self._requests: list[Request | None] = []
        self._current = -1  # index of the buffer being filled; -1 before the first write
        self._capacity = STAGING_BYTES  # bytes per staging buffer
        self._filling = False  # whether the current buffer takes bytes (not yet submitted)
        self._fill = 0  # bytes in the current buffer
        self._written = 0  # file offset where the current buffer goes
        self._position = 0  # bytes accepted so far

    # -- io.RawIOBase ------------------------------------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._position

    def write(self, data) -> int:
        source = memoryview(data).cast("B")
        nbytes = source.nbytes
        address = address_of(source)
        self._position += nbytes
        if self.error is not None:
            return nbytes
        if self.closed:
            raise ValueError(f"write to closed DirectWriter of {self.path}")
        done = 0
        try:
            while done < nbytes:
                if not self._filling:
                    self._next_buffer()
                take = min(nbytes - done, self._capacity - self._fill)
                ctypes.memmove(self._staging[self._current].data_ptr() + self._fill, address + done, take)
                self._fill += take
                done += take
                if self._fill == self._capacity:
                    self._submit()
        except OSError as e:
            self._fail(e)
        return nbytes

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        self.drain()
        if self.error is not None:
            raise self.error
        return self._fd

    def close(self) -> None:
        """Write what is buffered, wait for every write, fsync (with ``sync``), release the staging buffers; raise
        the first write error."""
        if self.closed:
            return
        try:
            self.drain()
            if self.error is None and self.sync:
                try:
                    os.fsync(self._fd)
                except OSError as e:
                    self._fail(OSError(e.errno, f"{e.strerror} during fsync", self.path))
        finally:
            os.close(self._fd)
            for buffer, request in zip(self._staging, self._requests):
                if request is None:  # a write still in flight (interrupted wait) keeps its buffer to itself
                    _give_staging(buffer)
            self._staging, self._requests = [], []
            super().close()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop writing: wait for writes in flight (their memory must outlive them), drop the rest, close."""
        if self.error is None:
            self.error = OSError(f"writing {self.path} was aborted")
        self._wait_all()
        try:
            self.close()
        except OSError:
            pass

    # -- internals ---------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Submit the partly filled buffer and wait for every write in flight."""
        if self.error is None and self._filling and self._fill:
            self._submit()
        self._wait_all()

    def _next_buffer(self) -> None:
        if len(self._staging) < STAGING_BUFFERS:
            buffer = _take_staging()
            self._staging.append(buffer)
            self._requests.append(None)
            self._current = len(self._staging) - 1
        else:
            self._current = (self._current + 1) % STAGING_BUFFERS
            self._wait(self._current)
            if self.error is not None:
                raise self.error
        self._fill = 0
        self._filling = True

    def _submit(self) -> None:
        buffer = self._staging[self._current][:self._fill]
        self._requests[self._current] = self._handle.write_async(buffer, self.path, self._written, truncate=False)
        self._written += self._fill
        self._fill = 0
        self._filling = False

    def _wait(self, index: int) -> None:
        request = self._requests[index]
        if request is None:
            return
        self._requests[index] = None
        try:
            request.wait()
        except OSError as e:
            self._fail(e)

    def _wait_all(self) -> None:
        for index in range(len(self._requests)):
            self._wait(index)

    def _fail(self, error: OSError) -> None:
        if self.error is None:
            self.error = error


class DirectReader(io.RawIOBase):
    """A seekable read-only stream over ``path`` that reads ahead through the op.

    A read of ``DIRECT_READ_MIN`` bytes or more starts (or moves) a read-ahead window: the ``READ_AHEAD`` chunks of
    ``STAGING_BYTES`` bytes from the one holding the read's first byte are read asynchronously into aligned, page-locked
    buffers (large aligned O_DIRECT requests), and reads are copied out of them. As reads move forward, chunks behind
    them are reused for the chunks ahead, so a file read front to back (as ``torch.load`` reads a ``torch.save``
    file) is read at the op's full queue depth. Small reads outside the window (zip headers) and large reads behind
    it are plain ``pread``s or direct op reads.

    ``on_read(offset, view)`` is called after each read with the file offset and the bytes read (used to verify
    checksums); an exception it raises fails the read. ``error`` keeps the first exception a read raised.
    """

    def __init__(self, path: str | os.PathLike, *, config: AioConfig | None = None,
                 on_read: Callable[[int, memoryview], None] | None = None):
        super().__init__()
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.size = os.fstat(self._fd).st_size
        self._position = 0
        self._handle = shared_handle(config)
        self._on_read = on_read
        self.error: BaseException | None = None  # the first exception a read raised
        self._chunks: dict[int, list] = {}  # chunk index -> [buffer, request or None, bytes]
        self._free: list[torch.Tensor] = []
        self._chunk = STAGING_BYTES  # bytes per read-ahead chunk

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, f"negative seek position {base + offset}", self.path)
        self._position = base + offset
        return self._position

    def readinto(self, buffer) -> int:
        try:
            return self._readinto(buffer)
        except BaseException as e:  # torch's zip reader hides its source's exceptions: keep the first for load()
            if self.error is None:
                self.error = e
            raise

    def _readinto(self, buffer) -> int:
        target = memoryview(buffer).cast("B")
        nbytes = max(0, min(target.nbytes, self.size - self._position))
        if nbytes == 0:
            return 0
        view = target[:nbytes]
        position = self._position
        first = position // self._chunk
        behind = bool(self._chunks) and first < min(self._chunks)
        if not behind and (nbytes >= DIRECT_READ_MIN or first in self._chunks):
            self._copy_ahead(view, position)
        elif nbytes >= DIRECT_READ_MIN:
            self._handle.read(torch.frombuffer(view, dtype=torch.uint8), self.path, position)
        else:
            self._pread(view, position)
        if self._on_read is not None:
            self._on_read(position, view)
        self._position = position + nbytes
        return nbytes

    def _pread(self, view: memoryview, position: int) -> None:
        done = 0
        while done < view.nbytes:
            got = os.preadv(self._fd, [view[done:]], position + done)
            if got == 0:
                raise OSError(errno.ENODATA, f"file ended at offset {position + done} while reading", self.path)
            done += got

    def _copy_ahead(self, view: memoryview, position: int) -> None:
        done, end, address = 0, position + view.nbytes, address_of(view)
        for index in range(position // self._chunk, (end - 1) // self._chunk + 1):
            self._advance(index)
            chunk = self._chunks[index]
            if chunk[1] is not None:
                try:
                    chunk[1].wait()
                except BaseException:
                    del self._chunks[index]  # never serve a chunk whose read failed (or is still running)
                    raise
                chunk[1] = None
            start = max(position, index * self._chunk) - index * self._chunk
            take = min(end, index * self._chunk + chunk[2]) - index * self._chunk - start
            ctypes.memmove(address + done, chunk[0].data_ptr() + start, take)
            done += take

    def _advance(self, first: int) -> None:
        """Make the window start at chunk ``first``: recycle the chunks before it, start reading the ones after."""
        for index in [i for i in self._chunks if i < first]:
            self._release(index)
        last = min(first + READ_AHEAD, -(-self.size // self._chunk))
        for index in range(first, last):
            if index not in self._chunks:
                buffer = self._free.pop() if self._free else _take_staging()
                length = min(self._chunk, self.size - index * self._chunk)
                request = self._handle.read_async(buffer[:length], self.path, index * self._chunk)
                self._chunks[index] = [buffer, request, length]

    def _release(self, index: int) -> None:
        buffer, request, _ = self._chunks.pop(index)
        if request is not None:
            try:
                request.wait()  # its memory must outlive the read; nobody needs its bytes or its error
            except OSError:
                pass
        self._free.append(buffer)

    def close(self) -> None:
        if not self.closed:
            for index in list(self._chunks):
                self._release(index)
            for buffer in self._free:
                _give_staging(buffer)
            self._free = []
            os.close(self._fd)
        super().close()
