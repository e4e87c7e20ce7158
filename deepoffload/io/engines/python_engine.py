"""``PythonEngine``: the base of an engine written in Python, whose transfers run on a few Python threads.

A subclass names itself and implements ``transfer`` (one ``os.pread``-like or ``os.pwrite``-like call, which may move
fewer bytes than asked); this base opens and closes files, repeats short transfers, reports reading past the end of
a file as ENODATA, truncates and syncs as asked, and returns each outcome as the ``Result`` tuple the handle reads.
It is for engines whose speed does not matter (a test's, a platform's first port); the native engines stay the fast
path.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import itertools
import os
import threading

from .registry import FSYNC, TRUNCATE, Backend, Result


class PythonEngine:
    """An engine in Python: subclass it, set ``name`` and ``description``, implement ``transfer``, ``register`` it.

    Attributes:
        name: The engine's name (``engine=``).
        description: One line for the report.
        native: Always False.
    """

    name = ""
    description = ""
    native = False

    def transfer(self, write: bool, fd: int, view: memoryview, offset: int) -> int:
        """Move the bytes of ``view`` to (``write``) or from ``fd`` at ``offset`` in one call.

        Args:
            write: True to write ``view`` to the file, False to read into it.
            fd: The open descriptor.
            view: The memory (a writable byte view for reads).
            offset: The file offset (bytes).

        Returns:
            The bytes moved (fewer than ``len(view)`` is allowed; 0 on a read means the end of the file).

        Raises:
            OSError: When the call fails.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement transfer()")

    def status(self) -> tuple[bool, str]:
        """(usable, why not): a Python engine is usable wherever Python runs.

        Returns:
            ``(True, "")``.
        """
        return True, ""

    def open(
        self, *, block_size: int, queue_depth: int, single_submit: bool, overlap_events: bool, intra_op_parallelism: int
    ) -> Backend:
        """A backend running this engine's transfers on ``intra_op_parallelism`` threads.

        Args:
            block_size: Bytes per ``transfer`` call at most.
            queue_depth: Not used (one call at a time per thread).
            single_submit: Not used.
            overlap_events: Not used.
            intra_op_parallelism: Threads running transfers.

        Returns:
            The backend.
        """
        return _ThreadBackend(self, block_size, intra_op_parallelism)


class _ThreadBackend:
    """``Backend`` of a ``PythonEngine``: each transfer runs whole on one thread of a pool."""

    def __init__(self, engine: PythonEngine, block_size: int, threads: int):
        self._engine, self._block_size = engine, block_size
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"deepoffload-{engine.name}")
        self._ops: dict[int, concurrent.futures.Future[Result]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def submit(self, write: bool, ptr: int, nbytes: int, path: bytes, fd: int, offset: int, flags: int) -> int:
        future = self._pool.submit(self._run, write, ptr, nbytes, path, fd, offset, flags)
        with self._lock:
            op_id = next(self._ids)
            self._ops[op_id] = future
        return op_id

    def wait(self, op_id: int, timeout_s: float) -> Result | None:
        future = self._future(op_id)
        try:
            result = future.result(None if timeout_s < 0 else timeout_s)
        except concurrent.futures.TimeoutError:  # still running: None is the protocol's "not finished yet"
            return None
        with self._lock:
            self._ops.pop(op_id, None)
        return result

    def done(self, op_id: int) -> bool:
        return self._future(op_id).done()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _future(self, op_id: int) -> concurrent.futures.Future[Result]:
        with self._lock:
            future = self._ops.get(op_id)
        if future is None:
            raise ValueError(f"unknown op id {op_id}")
        return future

    def _run(self, write: bool, ptr: int, nbytes: int, path: bytes, fd: int, offset: int, flags: int) -> Result:
        name = os.fsdecode(path)
        operation = "open"
        position = offset
        own = fd < 0
        try:
            if own:
                fd = os.open(path, (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY, 0o644)
            try:
                view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B") if nbytes else memoryview(b"")
                operation = "write" if write else "read"
                done = 0
                while done < nbytes:
                    piece = view[done : done + min(self._block_size, nbytes - done)]
                    moved = self._engine.transfer(write, fd, piece, offset + done)
                    if moved <= 0:
                        position = offset + done
                        error = errno.EIO if write else errno.ENODATA  # nothing moved: past the end, or a stuck write
                        return error, operation, name, position, "no bytes moved", None
                    done += moved
                if write and flags & TRUNCATE:
                    operation = "truncate"
                    os.ftruncate(fd, offset + nbytes)
                if write and flags & FSYNC:
                    operation = "fsync"
                    os.fsync(fd)
            finally:
                if own:
                    os.close(fd)
        except OSError as e:
            return e.errno or errno.EIO, operation, name, position, "", None
        return 0, operation, name, offset, "", None
