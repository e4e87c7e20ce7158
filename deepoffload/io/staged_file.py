"""Double-buffered, page-aligned staging between memory and a file through the async-IO op.

The one implementation behind checkpoint streams (``deepoffload.checkpoint``), safetensors writing
(``deepoffload.formats``) and accelerator staging (``DeviceStager``).

``StagedWriter`` writes a byte sequence from a file offset: bytes are copied (or produced by the caller, e.g. a device
copy) into one of ``count`` aligned buffers; each full buffer is written with one large aligned (O_DIRECT where the
filesystem allows) request while the next fills, and a buffer is refilled only after its write has completed.
``StagedReader`` reads a byte range in chunks of one buffer each, keeping the chunks after the one in use in flight.
Buffers come from a ``StagingPool`` and go back to it only when no transfer uses them.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, Protocol

import torch

from ..pending import Pending
from .buffers import PAGE_SIZE, aligned_empty
from .inputs import FileRef

DIGEST_SLICE = 4 << 20  # bytes copied per digest call: small enough to stay in the CPU's cache


class Transfers(Protocol):
    """What the staged readers and writers need of a handle: ``AsyncIOHandle``'s asynchronous reads and writes."""

    def read_async(self, tensor: torch.Tensor, file: FileRef, offset: int = 0) -> Pending[int]:
        """Start reading ``tensor.nbytes`` bytes at ``offset`` of ``file`` into ``tensor``."""
        ...

    def write_async(
        self, tensor: torch.Tensor, file: FileRef, offset: int = 0, *, truncate: bool | None = None, fsync: bool = False
    ) -> Pending[int]:
        """Start writing ``tensor``'s bytes at ``offset`` of ``file``."""
        ...


class StagingPool:
    """Idle aligned buffers of one size, reused by writers and readers. Thread-safe.

    Args:
        buffer_bytes: The size of each buffer, a positive multiple of the page size.
        keep: At most this many idle buffers are kept; more given back are dropped.
        pin: Page-lock the buffers (see ``aligned_empty``).

    Raises:
        ValueError: When ``buffer_bytes`` is not a positive multiple of the page size.
    """

    def __init__(self, buffer_bytes: int, keep: int, *, pin: bool = True):
        if (
            isinstance(buffer_bytes, bool)
            or not isinstance(buffer_bytes, int)
            or buffer_bytes <= 0
            or buffer_bytes % PAGE_SIZE
        ):
            raise ValueError(f"buffer_bytes must be a positive multiple of {PAGE_SIZE}, got {buffer_bytes!r}")
        self.buffer_bytes, self.keep, self.pin = buffer_bytes, keep, pin
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        """An idle buffer, or a new one when none is idle (a 1-D uint8 tensor of ``buffer_bytes``)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return aligned_empty(self.buffer_bytes, pin=self.pin)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer that no transfer uses any more (dropped when ``keep`` are idle already).

        Args:
            buffer: A buffer from ``take``.
        """
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(buffer)


class StagedWriter:
    """Writes bytes in order to a file through a few buffers of a pool. Not thread-safe.

    ``write`` copies from memory and submits each full buffer; ``reserve``/``commit``/``submit`` let the caller fill
    a buffer itself. A failed write is recorded in ``error`` and raised by the next ``write``, ``reserve``,
    ``submit`` or ``drain``; ``close`` (always call it) waits for every write in flight and returns the buffers to the
    pool.

    Args:
        handle: The handle that writes.
        file: A path or an open descriptor.
        offset: The file offset of the first byte written.
        pool: Where the buffers come from.
        count: How many buffers are used in turn (one fills while the others are written).
    """

    def __init__(self, handle: Transfers, file: FileRef, offset: int = 0, *, pool: StagingPool, count: int = 2):
        self.handle, self.file, self.pool, self.count = handle, file, pool, count
        self.offset = offset  # file offset where the buffer being filled goes
        self.error: OSError | None = None
        self._buffers: list[torch.Tensor] = []
        self._requests: list[Pending[int] | None] = []
        self._current = -1  # index of the buffer being filled
        self._filling = False  # whether the current buffer takes bytes (not yet submitted)
        self._fill = 0  # bytes in the current buffer

    @property
    def buffered(self) -> int:
        """Bytes accepted but not yet submitted."""
        return self._fill if self._filling else 0

    def write(self, address: int, nbytes: int, digest: Callable[[int, int], None] | None = None) -> None:
        """Copy ``nbytes`` bytes from memory at ``address``; every buffer filled is submitted.

        Args:
            address: Where the bytes start in memory.
            nbytes: How many bytes to copy.
            digest: Called as ``digest(address, nbytes)`` on each piece (of at most ``DIGEST_SLICE`` bytes) right
                after it was copied into its buffer, while it is in the CPU's cache: one pass over the source serves
                the copy and the digest. None: no digest.
        """
        done = 0
        limit = DIGEST_SLICE if digest is not None else nbytes
        while done < nbytes:
            buffer = self.reserve()
            take = min(nbytes - done, buffer.numel(), limit)
            ctypes.memmove(buffer.data_ptr(), address + done, take)
            if digest is not None:
                digest(buffer.data_ptr(), take)
            done += take
            self.commit(take)
            if self._fill == self.pool.buffer_bytes:
                self.submit()

    def reserve(self) -> torch.Tensor:
        """The unfilled part of the buffer being filled.

        When a new buffer is started, this first waits for the write that last used it. Fill a prefix of it,
        ``commit`` those bytes, and ``submit`` when done with the buffer. An earlier write's error is raised here.

        Returns:
            A 1-D uint8 view of the buffer's unfilled part.
        """
        self._raise()
        if not self._filling:
            self._next_buffer()
        return self._buffers[self._current][self._fill :]

    def commit(self, nbytes: int) -> None:
        """Count ``nbytes`` bytes of ``reserve()`` as filled.

        Args:
            nbytes: How many bytes at the start of the reserved part were filled.
        """
        self._fill += nbytes

    def submit(self, *, truncate: bool = False, fsync: bool = False) -> None:
        """Start writing the filled part of the current buffer at its offset (nothing when no buffer is being filled).

        An earlier write's error is raised here.

        Args:
            truncate: Cut the file where this write ends.
            fsync: Make the data durable; first waits for every earlier write, so that the fsync covers them.
        """
        self._raise()
        if not self._filling:
            return
        if fsync:
            for index in range(len(self._requests)):
                if index != self._current:
                    self._wait(index)
            self._raise()
        buffer = self._buffers[self._current][: self._fill]
        self._requests[self._current] = self.handle.write_async(
            buffer, self.file, self.offset, truncate=truncate, fsync=fsync
        )
        self.offset += self._fill
        self._fill = 0
        self._filling = False

    def drain(self) -> None:
        """Submit what is buffered, wait for every write, raise the first error."""
        if self.error is None and self.buffered:
            self.submit()
        self.wait_all()
        self._raise()

    def wait_all(self) -> None:
        """Wait for every write in flight; errors are recorded, not raised."""
        for index in range(len(self._requests)):
            self._wait(index)

    def close(self) -> None:
        """Wait for every write in flight (errors stay in ``error``) and return the buffers to the pool.

        Bytes not submitted are dropped.
        """
        self.wait_all()
        for buffer, request in zip(self._buffers, self._requests):
            if request is None:  # a write whose wait was interrupted keeps its buffer to itself
                self.pool.give(buffer)
        self._buffers, self._requests, self._filling = [], [], False

    # -- internals ---------------------------------------------------------------------------------------------
    def _next_buffer(self) -> None:
        if len(self._buffers) < self.count:
            self._buffers.append(self.pool.take())
            self._requests.append(None)
            self._current = len(self._buffers) - 1
        else:
            self._current = (self._current + 1) % self.count
            self._wait(self._current)
            self._raise()
        self._fill = 0
        self._filling = True

    def _wait(self, index: int) -> None:
        request = self._requests[index]
        if request is None:
            return
        try:
            request.wait()
        except OSError as e:
            if self.error is None:
                self.error = e
        self._requests[index] = None  # completed (an interrupted wait leaves it in flight)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


class StagedReader:
    """Reads a byte range of a file in chunks of one pool buffer each. Not thread-safe; always ``close`` it.

    Chunk ``i`` covers ``start + i * pool.buffer_bytes`` onwards. ``get(i)`` moves the window to start at chunk ``i``
    (chunks before it are recycled, chunks ``i`` to ``i + depth - 1`` are read asynchronously), waits for chunk ``i``
    and returns its bytes: a view of a buffer, valid until the window moves past it. A chunk whose read failed is
    dropped, so its bytes are never served.

    Args:
        handle: The handle that reads.
        file: A path or an open descriptor.
        start: The file offset of the first byte read.
        end: The file offset where the range ends (exclusive).
        pool: Where the buffers come from; its ``buffer_bytes`` is the chunk size.
        depth: How many chunks the window keeps read or in flight.
    """

    def __init__(self, handle: Transfers, file: FileRef, start: int, end: int, *, pool: StagingPool, depth: int = 2):
        self.handle, self.file, self.start, self.end, self.pool, self.depth = handle, file, start, end, pool, depth
        self.chunk_bytes = pool.buffer_bytes
        self.chunk_count = -(-(end - start) // self.chunk_bytes)
        self._chunks: dict[int, list] = {}  # chunk index -> [buffer, request or None, bytes]
        self._free: list[torch.Tensor] = []

    def lowest(self) -> int | None:
        """The first chunk in the window (None when empty)."""
        return min(self._chunks) if self._chunks else None

    def holds(self, index: int) -> bool:
        """Whether chunk ``index`` is in the window (read or being read).

        Args:
            index: The chunk's index.

        Returns:
            True when the window holds the chunk.
        """
        return index in self._chunks

    def get(self, index: int, *, advance: bool = True) -> torch.Tensor:
        """Chunk ``index``'s bytes, once its read has completed.

        Args:
            index: The chunk's index.
            advance: Move the window to start at ``index`` first; False serves a chunk the window holds without
                moving it (``KeyError`` when it does not hold it).

        Returns:
            A 1-D uint8 view of a buffer, valid until the window moves past the chunk.

        Raises:
            OSError: When the chunk's read failed (the chunk is dropped from the window).
        """
        if advance:
            self._advance(index)
        chunk = self._chunks[index]
        if chunk[1] is not None:
            try:
                chunk[1].wait()
            except OSError:
                self._free.append(self._chunks.pop(index)[0])  # the read has completed, with an error
                raise
            except BaseException:
                del self._chunks[index]  # maybe still in flight: its request keeps the buffer alive
                raise
            chunk[1] = None
        return chunk[0][: chunk[2]]

    def close(self) -> None:
        """Wait for every read in flight and return the buffers to the pool."""
        for index in list(self._chunks):
            self._release(index)
        for buffer in self._free:
            self.pool.give(buffer)
        self._free = []

    def _advance(self, first: int) -> None:
        for index in [i for i in self._chunks if i < first]:
            self._release(index)
        for index in range(first, min(first + self.depth, self.chunk_count)):
            if index not in self._chunks:
                buffer = self._free.pop() if self._free else self.pool.take()
                position = self.start + index * self.chunk_bytes
                length = min(self.chunk_bytes, self.end - position)
                self._chunks[index] = [buffer, self.handle.read_async(buffer[:length], self.file, position), length]

    def _release(self, index: int) -> None:
        buffer, request, _ = self._chunks.pop(index)
        if request is not None:
            try:
                request.wait()  # its memory must outlive the read; nobody needs its bytes or its error
            except OSError:
                pass
        self._free.append(buffer)
