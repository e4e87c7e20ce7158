"""``ActivationStore``: one run's file of saved activations, written straight from the tensors, read back ahead.

Each stored tensor is one ``StoredBytes``: the bytes of one storage, at a page-aligned extent of the run's file
``<run folder>/activations.swp``. A write is one asynchronous write from the tensor's own memory (no copy in the
calling thread: the op's worker threads bounce memory that is not aligned for direct IO); at most
``buffer_count * chunk_bytes`` bytes of tensors are being written at once (beyond it the next save waits for the
oldest writes, or one tensor when larger). The tensor is kept until its write has completed, then let go (its memory
is released once written). A failed write keeps it for good and is reported once (``take_error``). A read goes into
a page-aligned buffer and is checked against the xxh3-64 of each ``chunk_bytes`` of the tensor's bytes, hashed
at the save, when checksums are on. Extents are handed out from the end of
the file; when no stored tensor is left the file starts again at offset 0.

The run folder is made by ``swap.folders.create_run_folder`` (rank-aware, private, removed at close and at exit; the
next run removes the folders of dead processes).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import threading
import weakref

import torch

from ..errors import ChecksumError, UnsupportedError
from ..io.buffers import PAGE_SIZE, aligned_empty
from ..io.handle import AsyncIOHandle
from ..io.request import Request
from ..swap.config import SwapConfig
from ..swap.folder_checks import check_run_folder, create_swap_file
from ..swap.folders import create_run_folder, keep_run_folder, remove_run_folder, remove_run_folder_if_owned
from ..swap.pool import GrowthTrim, round_up
from ..swap.records import hash_bytes

FILE_NAME = "activations.swp"
TRIM_BYTES = 32 << 20  # growth of the process's resident memory that makes ``released`` trim the heap
CHECK_BYTES = 16 << 20  # bytes let go between two looks at the resident memory


class StoredBytes:
    """The bytes of one storage on the run's file (or, until written, in memory).

    Attributes:
        nbytes: The storage's bytes. span: ``nbytes`` rounded up to the page size (the extent's length in the file).
        offset: The extent's byte offset in the file. device: where the storage lived (CPU memory).
        original: The saved tensor (detached: it shares the version counter), kept while writes are pending or after
            one failed. version: its version counter at the save.
        pending: Writes of it not yet completed. hashes: xxh3-64 of each chunk (None: checksums off).
        error: The ``OSError`` of a failed write (the bytes then stay in ``original``).
        reading: ``(request, buffer)`` of a read in flight. restored: the storage read back (weakly held), its
            bytes from ``skip`` on.
        index: The position in the forward's order (prefetch goes down from here). users: live handles.
        copied: ``original`` is a copy made at the save (``write(copy=True)``), not the saved tensor.
        skip: The byte offset of the bytes in the storage read back. drive: The run's store holding it.
    """

    __slots__ = (
        "nbytes",
        "span",
        "offset",
        "device",
        "original",
        "version",
        "pending",
        "hashes",
        "error",
        "reading",
        "restored",
        "index",
        "users",
        "copied",
        "skip",
        "drive",
    )

    def __init__(self, original: torch.Tensor, version: int, offset: int, index: int):
        self.nbytes = original.untyped_storage().nbytes()
        self.span = round_up(self.nbytes)
        self.offset = offset
        self.device = original.device
        self.original: torch.Tensor | None = original
        self.version = version
        self.pending = 0
        self.hashes: list[int] | None = None
        self.error: OSError | None = None
        self.reading: tuple[Request, torch.Tensor] | None = None
        self.restored: weakref.ref | None = None
        self.index = index
        self.users = 0
        self.copied = False
        self.skip = 0  # bytes from the start of the storage read back to the tensor's bytes
        self.drive = 0  # which store of the run holds it (``ActivationDrives``)


class ActivationStore:
    """One run's activation file and its async-IO handle.

    Not thread-safe by itself: ``ActivationOffload`` calls it under its lock.

    Args:
        config: Where and how (folder, bytes being written at once, checksums, aio settings).

    Raises:
        UnsupportedError: When ``config.folder`` is several folders (``ActivationDrives`` makes a store for each).
    """

    def __init__(self, config: SwapConfig):
        self.config = config
        if isinstance(config.folder, tuple):  # (offload_activations refuses it first, naming the alternative)
            raise UnsupportedError(f"saved activations go to one folder, got {list(config.folder)}")
        self.folder = create_run_folder(config.folder, None, config.trust_folder_owner)
        if config.keep_files:
            keep_run_folder(self.folder)
        weakref.finalize(self, remove_run_folder_if_owned, self.folder).atexit = False
        self.path = os.path.join(self.folder, FILE_NAME)
        create_swap_file(self.path)
        self.handle = AsyncIOHandle(config.aio)
        self.chunk = config.chunk_bytes  # bytes per checksum
        self.in_flight_bytes = config.buffer_count * config.chunk_bytes  # bytes of tensors being written, at most
        self._in_flight = 0
        self._writes: collections.deque[tuple[Request, StoredBytes]] = collections.deque()
        self._end = 0  # the file's next free offset
        self.live = 0  # StoredBytes not yet freed
        self.failed: OSError | None = None  # the first failed write, until reported
        self.reported = False
        self.bytes_written = 0
        self.bytes_read = 0
        self._reading = 0  # bytes of reads started and not yet handed out
        self.peak_held = 0  # the most bytes of tensors being written plus reads not yet handed out, at once
        self._trim = GrowthTrim(TRIM_BYTES, CHECK_BYTES)
        self.closed = False

    # -- writes ---------------------------------------------------------------------------------------------
    def write(self, original: torch.Tensor, version: int, index: int, copy: bool = False) -> StoredBytes:
        """Start writing the bytes of ``original``'s whole storage; ``original`` is kept until they are written.

        Args:
            original: The saved tensor, detached (in CPU memory).
            version: The saved tensor's version counter at the save.
            index: The position in the forward's order.
            copy: Copy the bytes now and write (and keep) the copy: for memory that may change after the save without
                its version counter moving (buffers a kernel updates in place, such as BatchNorm's running statistics).

        Returns:
            The record; its ``pending`` writes complete in the background (``reap``).
        """
        if copy:  # (views of a fresh clone: its version counter starts where the saved tensor's check expects)
            flat = torch.empty(0, dtype=torch.uint8).set_(original.untyped_storage()).clone().view(original.dtype)
            original = flat.as_strided(original.size(), original.stride(), original.storage_offset())
        stored = StoredBytes(original, version, self._end, index)
        stored.copied = copy
        self._end += stored.span
        self.live += 1
        check_run_folder(self.folder)
        data = torch.empty(0, dtype=torch.uint8).set_(original.untyped_storage())
        while self._writes and self._in_flight + stored.nbytes > self.in_flight_bytes:
            self._finish_oldest()  # bounded: wait for the oldest writes (and let their tensors go)
        if self.config.checksum:
            stored.hashes = [hash_bytes(data[s : s + self.chunk]) for s in range(0, stored.nbytes, self.chunk)]
        if stored.nbytes:  # straight from the tensor's memory: the op bounces misaligned memory on its own threads
            request = self.handle.write_async(data, self.path, stored.offset, truncate=False)
            self._writes.append((request, stored))
            self._in_flight += stored.nbytes
            self.peak_held = max(self.peak_held, self._in_flight + self._reading)
            stored.pending += 1
        else:
            stored.original = None
        return stored

    def _finish_oldest(self) -> None:
        request, stored = self._writes.popleft()
        self._in_flight -= stored.nbytes
        try:
            self.bytes_written += request.wait()
        except OSError as e:
            if stored.error is None:
                stored.error = OSError(
                    e.errno,
                    f"offload_activations: writing a saved tensor of {stored.nbytes} bytes to {self.path} at offset "
                    f"{stored.offset} failed ({e}); it stays in memory, and later saved tensors of this run too",
                    self.path,
                )
                self.failed = self.failed or stored.error
        stored.pending -= 1
        if not stored.pending and stored.error is None:
            stored.original = None  # written: its memory goes (unless the caller still holds the tensor)
            self.released(stored.nbytes)

    def released(self, nbytes: int) -> None:
        """``nbytes`` of tensors were let go; give freed heap pages back when the resident memory grew ``TRIM_BYTES``.

        Activations (and their gradients in backward) are mostly above glibc's initial mmap threshold: freeing one
        raises the threshold, later ones come from the heap, and freed heap memory stays in the process (RSS as high
        as keeping every saved tensor) until it is trimmed; ``swap.pool.GrowthTrim`` says when.
        """
        self._trim.released(nbytes)

    def reap(self, wait: bool = False) -> None:
        """Collect completed writes (``wait``: all of them), releasing their buffers and written tensors."""
        while self._writes and (wait or self._writes[0][0].done()):
            self._finish_oldest()

    def wait_for(self, stored: StoredBytes) -> None:
        """Wait until every write of ``stored`` has completed."""
        while stored.pending:
            self._finish_oldest()

    def take_error(self) -> OSError | None:
        """The first failed write, once (later calls return None).

        Returns:
            The ``OSError`` (errno, path and offset in it), or None.
        """
        if self.failed is None or self.reported:
            return None
        self.reported = True
        return self.failed

    # -- reads ----------------------------------------------------------------------------------------------
    def start_read(self, stored: StoredBytes) -> None:
        """Start reading ``stored`` back into a page-aligned buffer, unless in memory or already started.

        The buffer is a page-aligned slice of a tensor from torch's allocator (one page more than the bytes): memory
        the heap already holds (the forward's written tensors, freed gradients) is used again, where a mapping of its
        own would be faulted in and zeroed page by page, then unmapped, for every read.
        """
        if stored.reading is not None or stored.original is not None or self._restored(stored) is not None:
            return
        check_run_folder(self.folder)
        raw = torch.empty(stored.nbytes + PAGE_SIZE, dtype=torch.uint8)
        skip = -raw.data_ptr() % PAGE_SIZE
        if skip % 16:  # (torch's allocator aligns to 64 bytes: an offset in elements of any dtype)
            raw, skip = aligned_empty(stored.span, pin=False), 0
        buffer = raw[skip : skip + stored.nbytes]
        stored.skip = skip
        stored.reading = (self.handle.read_async(buffer, self.path, stored.offset), buffer)
        self._reading += stored.nbytes
        self.peak_held = max(self.peak_held, self._in_flight + self._reading)

    def bytes_of(self, stored: StoredBytes) -> tuple[torch.UntypedStorage, int]:
        """The storage of ``stored``'s bytes in memory: the original, the storage read back, or a read now.

        Args:
            stored: The record.

        Returns:
            An untyped storage in CPU memory and the byte offset of ``stored.nbytes`` bytes in it (0 for the
            original).

        Raises:
            OSError: When the read fails (errno, path, offset).
            ChecksumError: When the bytes read differ from those written.
        """
        if stored.original is not None:
            return stored.original.untyped_storage(), 0
        restored = self._restored(stored)
        if restored is not None:
            return restored, stored.skip
        self.start_read(stored)
        request, buffer = stored.reading  # type: ignore[misc]  # (set by start_read)
        stored.reading = None
        self._reading -= stored.nbytes
        self.bytes_read += request.wait()
        if stored.hashes is not None:
            self._check(stored, buffer)
        storage = buffer.untyped_storage()
        stored.restored = weakref.ref(storage)
        return storage, stored.skip

    @staticmethod
    def _restored(stored: StoredBytes) -> torch.UntypedStorage | None:
        return None if stored.restored is None else stored.restored()

    def _check(self, stored: StoredBytes, buffer: torch.Tensor) -> None:
        for i, expected in enumerate(stored.hashes or ()):
            start = i * self.chunk
            end = min(start + self.chunk, stored.nbytes)
            if hash_bytes(buffer[start:end]) != expected:
                raise ChecksumError(
                    errno.EIO,
                    f"offload_activations: the saved tensor's bytes [{stored.offset + start}, {stored.offset + end}) "
                    f"of {self.path} changed on storage after they were written (xxh3-64 differs): the file was "
                    f"changed under the run; the backward cannot go on",
                    self.path,
                )

    # -- lifetime -------------------------------------------------------------------------------------------
    def free(self, stored: StoredBytes) -> None:
        """``stored`` is no longer needed; its extent is reused once nothing is stored (pending writes finish)."""
        stored.restored = None
        if stored.reading is not None:  # read ahead, never used
            self._reading -= stored.nbytes
        stored.reading = None
        if stored.error is not None:
            stored.original = None
        self.released(stored.nbytes)
        self.live -= 1
        if not self.live:
            self.reap(wait=True)
            self._end = 0  # nothing stored: the file starts again

    def close(self) -> None:
        """Wait for pending writes, close the handle and remove the run folder (unless kept); idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.reap(wait=True)
        finally:
            self.handle.close()
            if not self.config.keep_files:
                held = _hold_open(self.path)
                remove_run_folder(self.folder)
                if held is not None:
                    _close_later(held)

    @property
    def file_bytes(self) -> int:
        """Bytes of the file in use (up to the end of the last extent handed out)."""
        return self._end


def _hold_open(path: str) -> int | None:
    """A descriptor of ``path`` (None where it cannot be opened): the file's blocks stay allocated while it is open."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags)
    except OSError:  # (gone or replaced by a link: the folder's removal then frees it, in the foreground)
        return None


def _close_later(fd: int) -> None:
    """Close ``fd`` on a thread of its own: the last close of an unlinked file frees its blocks.

    Freeing the blocks of a file of hundreds of MiB takes a tenth of a second or more (the filesystem's extent work,
    and the discards of a folder mounted with ``discard``), all of it waiting; the run folder is already gone when
    this is called, so nothing observable changes (the space comes back once the thread is done, and at the
    latest when the process ends).
    """
    threading.Thread(target=_close_quietly, args=(fd,), name="deepoffload-activations-free", daemon=True).start()


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
