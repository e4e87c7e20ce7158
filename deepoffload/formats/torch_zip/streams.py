"""File-like streams whose bytes move through the async-IO op.

They are what ``torch.save``/``torch.load`` (and DCP's filesystem storage) write to and read from.

``DirectWriter`` copies whatever it is given into page-aligned, page-locked staging buffers and writes each full
buffer with one large aligned (O_DIRECT where the filesystem allows) write while the next buffer fills: serialization
and IO overlap. ``DirectReader`` reads ahead in large aligned chunks and serves reads from them. Both stage through
``deepoffload.io.staged_file``.
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

from ...config import AioConfig
from ...errors import ClosedError
from ...io.handle import AsyncIOHandle
from ...io.staged_file import StagedReader, StagedWriter, StagingPool

STAGING_BYTES = 16 << 20  # per staging buffer; a multiple of every O_DIRECT alignment
STAGING_BUFFERS = 8  # one fills while the others are written: IO stays queued while the disk is uneven
DIRECT_READ_MIN = 256 << 10  # reads this large go through the op; smaller ones are plain preads
READ_AHEAD = 4  # read-ahead chunks in flight

_handles: dict[AioConfig, AsyncIOHandle] = {}
_handles_lock = threading.Lock()
_pools: dict[int, StagingPool] = {}  # by buffer bytes
_pools_lock = threading.Lock()


def staging_pool() -> StagingPool:
    """The process-wide pool of ``STAGING_BYTES`` buffers (idle ones kept: enough for one writer and one reader)."""
    with _pools_lock:
        pool = _pools.get(STAGING_BYTES)
        if pool is None:
            pool = _pools[STAGING_BYTES] = StagingPool(STAGING_BYTES, keep=STAGING_BUFFERS + READ_AHEAD)
        return pool


def shared_handle(config: AioConfig | None = None) -> AsyncIOHandle:
    """One handle per config for all checkpoint IO of this process (handles are thread-safe)."""
    config = config or AioConfig.from_env()
    with _handles_lock:
        handle = _handles.get(config)
        if handle is None or handle._closed:
            handle = _handles[config] = AsyncIOHandle(config)
        return handle


def address_of(view: memoryview) -> int:
    """The address of a contiguous memoryview's first byte (read-only views too)."""
    if view.nbytes == 0:
        return 0
    with warnings.catch_warnings():  # torch warns that a read-only buffer is not writable; only its address is used
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


def _preallocate(fd: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` for a file about to be written front to back.

    Its writes then do not each allocate blocks and extend the file.

    Args:
        fd: The file's descriptor.
        nbytes: The bytes to reserve.

    Returns:
        Whether that was done (not every filesystem can).
    """
    if nbytes <= 0 or not hasattr(os, "posix_fallocate"):
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:  # this filesystem cannot preallocate: the writes extend the file instead, as the caller is told
        return False
    return True


class DirectWriter(io.RawIOBase):
    """A write-only stream into ``path`` (created or truncated) through the async-IO op.

    Writes are sequential. A new file gets ``mode`` (less the umask). ``size_hint`` (bytes, about what will be
    written) preallocates the file; ``close()`` cuts it to what was written. Each full staging buffer is written
    asynchronously at its file offset; ``close()`` writes the tail, waits for everything, and with ``sync`` fsyncs
    the file. ``flush()`` does nothing (bytes reach the file at the latest on ``close()``); ``fileno()`` first writes
    out everything buffered, so an ``os.fsync(fileno())`` before ``close()`` (what DCP's writer does) covers every
    byte written so far.

    After a write fails, later writes are accepted and dropped (torch's zip writer aborts the process if its sink
    raises and it is then finalized), and ``close()`` raises the first error; ``error`` holds it meanwhile.

    Args:
        path: The file to write (created or truncated).
        config: The async-IO settings (default: ``AioConfig.from_env()``); one handle per config serves all
            checkpoint IO.
        sync: Whether ``close()`` fsyncs the file.
        size_hint: About the bytes that will be written: preallocated, and cut to what was written on ``close()``.
        mode: The permissions of a new file (less the umask).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        config: AioConfig | None = None,
        sync: bool = True,
        size_hint: int = 0,
        mode: int = 0o666,
    ):
        super().__init__()
        self.path = os.fspath(path)
        self.sync = sync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), mode)
        self._allocated = _preallocate(self._fd, size_hint)
        self._staged = StagedWriter(shared_handle(config), self.path, 0, pool=staging_pool(), count=STAGING_BUFFERS)
        self._position = 0  # bytes accepted so far

    @property
    def error(self) -> OSError | None:
        """The first write error (None while all is well)."""
        return self._staged.error

    # -- io.RawIOBase ------------------------------------------------------------------------------------------
    def writable(self) -> bool:
        """Return True: the stream is written."""
        return True

    def seekable(self) -> bool:
        """Return False: writes are sequential."""
        return False

    def tell(self) -> int:
        """Return the bytes accepted so far."""
        return self._position

    def write(self, data) -> int:
        """Stage all of ``data``; full staging buffers are written asynchronously.

        After a write failed, ``data`` is accepted and dropped (``close()`` raises the error).

        Args:
            data: A bytes-like object.

        Returns:
            The bytes accepted: all of ``data``.

        Raises:
            ClosedError: When the stream is closed (and no write failed before).
        """
        source = memoryview(data).cast("B")
        nbytes = source.nbytes
        self._position += nbytes
        if self.error is not None:
            return nbytes
        if self.closed:
            raise ClosedError(f"write to closed DirectWriter of {self.path}")
        try:
            self._staged.write(address_of(source), nbytes)
        except OSError:
            pass  # recorded in self.error; raised by close()
        return nbytes

    def write_digest(self, data, digest: Callable[[int, int], None]) -> int:
        """Like ``write``, calling ``digest(address, nbytes)`` on each piece as it is staged (see ``StagedWriter``).

        Args:
            data: A bytes-like object.
            digest: Called with each staged piece's address and size.

        Returns:
            The bytes accepted: all of ``data``.
        """
        source = memoryview(data).cast("B")
        nbytes = source.nbytes
        self._position += nbytes
        if self.error is None:
            try:
                self._staged.write(address_of(source), nbytes, digest)
            except OSError:
                pass  # recorded in self.error; raised by close()
        return nbytes

    def flush(self) -> None:
        """Do nothing: bytes reach the file at the latest on ``close()``."""
        pass

    def fileno(self) -> int:
        """Write out everything buffered, then return the file descriptor (an fsync of it covers every byte so far).

        Returns:
            The file's descriptor.

        Raises:
            OSError: The first write error, when a write failed.
        """  # noqa: DOC502 -- ruff cannot tell that the raised self.error is an OSError
        self.drain()
        if self.error is not None:
            raise self.error
        return self._fd

    def close(self) -> None:
        """Write what is buffered, wait for every write, fsync (with ``sync``) and release the staging buffers.

        Raises:
            OSError: The first write error (a failed write, truncate or fsync; errno and path in it).
        """  # noqa: DOC502 -- ruff cannot tell that the raised self.error is an OSError
        if self.closed:
            return
        try:
            self.drain()
            if self.error is None and self._allocated:
                try:
                    os.ftruncate(self._fd, self._position)  # the preallocated tail goes
                except OSError as e:
                    self._fail(OSError(e.errno, f"{e.strerror} during truncate to {self._position} bytes", self.path))
            if self.error is None and self.sync:
                try:
                    os.fsync(self._fd)
                except OSError as e:
                    self._fail(OSError(e.errno, f"{e.strerror} during fsync", self.path))
        finally:
            os.close(self._fd)
            self._staged.close()
            super().close()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop writing: wait for writes in flight (their memory must outlive them), drop the rest, close."""
        self._fail(OSError(f"writing {self.path} was aborted"))
        self._staged.wait_all()
        try:
            self.close()
        except OSError:  # the abort's own error is recorded first and is what the caller reports
            pass

    def drain(self) -> None:
        """Submit the partly filled buffer and wait for every write in flight (errors go to ``error``)."""
        try:
            self._staged.drain()
        except OSError:  # recorded in ``error``; fileno() and close() raise it
            pass

    def _fail(self, error: OSError) -> None:
        if self._staged.error is None:
            self._staged.error = error


class SeekableReader(io.RawIOBase):
    """A read-only, seekable raw stream of ``size`` bytes (torch's zip reader seeks around in it).

    A subclass sets ``size`` and implements ``readinto`` from ``_position``.
    """

    size: int
    _position: int = 0

    def readable(self) -> bool:
        """Return True: the stream is read."""
        return True

    def seekable(self) -> bool:
        """Return True: the stream seeks."""
        return True

    def tell(self) -> int:
        """Return the current position."""
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move the position, as ``io.RawIOBase.seek`` does (past the end is allowed; reads there return nothing).

        Args:
            offset: Bytes from ``whence``.
            whence: ``io.SEEK_SET``, ``io.SEEK_CUR`` or ``io.SEEK_END``.

        Returns:
            The new position.

        Raises:
            ValueError: When the position would be negative (``DirectReader``: ``OSError`` with ``EINVAL``).
        """  # noqa: DOC502 -- raised as self._negative_seek(...), which ruff cannot see through
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise self._negative_seek(base + offset)
        self._position = base + offset
        return self._position

    def _negative_seek(self, position: int) -> Exception:
        return ValueError(f"negative seek position {position}")


class DirectReader(SeekableReader):
    """A seekable read-only stream over ``path`` that reads ahead through the op.

    A read of ``DIRECT_READ_MIN`` bytes or more starts (or moves) a read-ahead window: the ``READ_AHEAD`` chunks of
    ``STAGING_BYTES`` bytes from the one holding the read's first byte are read asynchronously into aligned, page-locked
    buffers (large aligned O_DIRECT requests), and reads are copied out of them. As large reads move forward, chunks
    behind them are reused for the chunks ahead, so a file read front to back (as ``torch.load`` reads a
    ``torch.save`` file) is read at the op's full queue depth. Small reads (zip headers) are copied from the window
    without moving it (torch's zip reader reads an archive's end before its data: DCP's files hold one archive per
    tensor); outside it they are plain ``pread``s. Large reads behind the window are direct op reads.

    ``error`` keeps the first exception a read raised.

    Args:
        path: The file to read.
        config: The async-IO settings (default: ``AioConfig.from_env()``); one handle per config serves all
            checkpoint IO.
        on_read: Called as ``on_read(offset, view)`` after each read with the file offset and the bytes read (used
            to verify checksums); an exception it raises fails the read.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        config: AioConfig | None = None,
        on_read: Callable[[int, memoryview], None] | None = None,
    ):
        super().__init__()
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.size = os.fstat(self._fd).st_size
        self._position = 0
        self._handle = shared_handle(config)
        self._on_read = on_read
        self.error: BaseException | None = None  # the first exception a read raised
        self._staged = StagedReader(self._handle, self.path, 0, self.size, pool=staging_pool(), depth=READ_AHEAD)
        self._chunk = STAGING_BYTES  # bytes per read-ahead chunk

    def _negative_seek(self, position: int) -> Exception:
        return OSError(errno.EINVAL, f"negative seek position {position}", self.path)

    def readinto(self, buffer) -> int:
        """Read from the current position into ``buffer`` (see the class docstring for how).

        A failed read raises its exception (``OSError`` for a failed op or ``pread``; what ``on_read`` raised); the
        first one is also kept in ``error``, since torch's zip reader hides its source's exceptions.

        Args:
            buffer: A writable bytes-like object.

        Returns:
            The bytes read (0 at the end of the file).
        """
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
        first, last = position // self._chunk, (position + nbytes - 1) // self._chunk
        lowest = self._staged.lowest()
        behind = lowest is not None and first < lowest
        if nbytes < DIRECT_READ_MIN and all(self._staged.holds(i) for i in range(first, last + 1)):
            self._copy_ahead(view, position, advance=False)  # a header: the window stays for the data after it
        elif not behind and nbytes >= DIRECT_READ_MIN:
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

    def _copy_ahead(self, view: memoryview, position: int, advance: bool = True) -> None:
        done, end, address = 0, position + view.nbytes, address_of(view)
        for index in range(position // self._chunk, (end - 1) // self._chunk + 1):
            chunk = self._staged.get(index, advance=advance)
            start = max(position, index * self._chunk) - index * self._chunk
            take = min(end, index * self._chunk + chunk.numel()) - index * self._chunk - start
            ctypes.memmove(address + done, chunk.data_ptr() + start, take)
            done += take

    def close(self) -> None:
        """Stop the read-ahead (waiting for reads in flight) and close the file."""
        if not self.closed:
            self._staged.close()
            os.close(self._fd)
        super().close()
