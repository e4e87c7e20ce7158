"""``Request``: one asynchronous transfer of an ``AsyncIOHandle``, and the ``OSError`` a failed one raises.

A request keeps the tensors (and any staging buffer) its transfer uses alive until it is collected, waits in slices so
signals get through, and knows the process that started it: after a fork, only that process can wait for it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

from ..errors import UnsupportedError
from ..pending import Pending, deadline_after, remaining

WAIT_SLICE_S = 0.2
_warned_buffered: set[str] = set()
_fork_generation = 0  # incremented in each forked child: a Request from an earlier generation is the parent's


def os_error(err: int, operation: str, path: str, offset: int, detail: str) -> OSError:
    """The exception for a failed transfer: errno, operation, path and offset all in it.

    Args:
        err: The errno of the failure.
        operation: What failed (as the native op names it, e.g. ``"write"``, ``"open"``).
        path: The file's path, or ``"<fd N>"`` for a descriptor.
        offset: The file offset of the transfer.
        detail: More about the failure, appended in parentheses (empty: none).

    Returns:
        An ``OSError`` (the subclass for ``err``, e.g. ``FileNotFoundError``) with ``path`` as its filename.
    """
    message = f"{os.strerror(err)} during {operation} at offset {offset}"
    if detail:
        message += f" ({detail})"
    return OSError(err, message, path)


class Request(Pending[int]):
    """One asynchronous transfer (a ``Pending``): ``wait()`` returns the bytes moved or raises ``OSError``.

    ``done()`` polls. Requests are made by ``AsyncIOHandle.read_async``/``write_async``, not by hand; used as a
    context manager, a request is waited for when the block ends.

    Args:
        backend: The engine's handle that runs the transfer (the native ``Handle``, or a Python engine's): its
            ``wait(op_id, timeout_s)`` and ``done(op_id)`` are used.
        op_id: The backend's id of the transfer.
        nbytes: The bytes the transfer moves (what ``wait`` returns; also the ``nbytes`` attribute).
        path: The file's path, or ``"<fd N>"`` for a descriptor (named in errors; also the ``path`` attribute).
        keep_alive: Tensors and staging buffers the native side uses, kept alive until the transfer is collected.
        finish: Called once after the transfer succeeded (e.g. the copy of a staging buffer to the device), or None;
            what it raises becomes the request's error.
        owned_fd: The copy of a caller's descriptor that this transfer uses, closed once it is collected (-1: none).
        created: The path of a write that did not exist when it was submitted, removed if the write fails (a full
            disk must not leave a new short or empty file behind), or None.
        on_collected: A weak reference (``weakref.WeakMethod``) to what is called with ``op_id`` once the transfer
            is collected (the submitting handle's bookkeeping), or None.

    Examples:
        >>> import torch, deepoffload
        >>> with deepoffload.AsyncIOHandle() as handle:
        ...     request = handle.write_async(torch.zeros(256), "zeros.bin")
        ...     request.wait()
        ...     request.done()
        1024
        True
    """

    def __init__(
        self,
        backend: Any,
        op_id: int,
        nbytes: int,
        path: str,
        keep_alive: tuple,
        finish: Callable[[], None] | None,
        owned_fd: int = -1,
        created: str | None = None,
        on_collected: "weakref.WeakMethod[Callable[[int], None]] | None" = None,
    ):
        self._on_collected = on_collected
        self._backend = backend
        self._op_id = op_id
        self.nbytes = nbytes
        self.path = path
        self._keep_alive = keep_alive  # tensors and staging buffers the native side is using
        self._finish = finish
        self._owned_fd = owned_fd  # the copy of a caller's descriptor this transfer uses; closed once collected
        self._created = created  # a new file this write made: removed if it fails
        self._lock = threading.Lock()
        self._collected = False
        self._error: BaseException | None = None
        self._generation = _fork_generation
        self._pid = os.getpid()

    def done(self) -> bool:
        """Whether the transfer has finished (successfully or not); never blocks and never raises its error.

        In a forked child, asking about a transfer the parent started raises ``UnsupportedError`` (a
        ``RuntimeError``): it runs in the parent, not here.

        Returns:
            True once the transfer has finished.

        Raises:
            ValueError: When the native handle does not know the transfer and no other thread is collecting it
                (not expected).
        """
        if self._collected:
            return True
        self._check_process()
        try:
            return self._backend.done(self._op_id)
        except ValueError:  # "unknown op id": another thread's wait took the result (only a finished op's) and is
            if self._collected or self._lock.locked():  # recording it under the lock, or has recorded it
                return True
            raise

    def wait(self, timeout: float | None = None) -> int:
        """Block until the transfer finishes; return its bytes or raise its ``OSError``.

        The error raised is the transfer's ``OSError`` (errno, operation, path and offset in it) or, for a tensor
        staged through host memory, the failure of its copy to the device. Waiting again returns the same result (or
        raises the same error). In a forked child, waiting for a transfer the parent started raises
        ``UnsupportedError`` (a ``RuntimeError``).

        Args:
            timeout: Seconds to wait at most (>= 0); None waits until the transfer finishes.

        Returns:
            The bytes moved (the request's ``nbytes``).

        Raises:
            TimeoutError: When the transfer has not finished after ``timeout`` seconds (nothing is lost: a later wait
                picks it up).
        """
        deadline = deadline_after(timeout)
        self._check_process()
        if not self._lock.acquire(timeout=-1 if deadline is None else min(remaining(deadline), threading.TIMEOUT_MAX)):
            raise TimeoutError(f"transfer of {self.nbytes} bytes to/from {self.path} still running")
        try:
            if not self._collected:
                self._collect(deadline)
        finally:
            self._lock.release()
        if self._error is not None:
            raise self._error
        return self.nbytes

    def _check_process(self) -> None:
        if self._generation != _fork_generation:  # a forked child holding a copy of the parent's request
            raise UnsupportedError(
                f"the transfer of {self.nbytes} bytes to/from {self.path} was started by process "
                f"{self._pid} before it forked; it runs there, and only that process can wait for it"
            )

    def _collect(self, deadline: float | None) -> None:
        results: list = []
        try:
            while True:  # in slices so Ctrl-C (or any signal handler's exception) gets through
                slice_s = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, remaining(deadline))
                # stored from C (extend calls wait), so the exception of a signal that arrived meanwhile is raised
                # only once the result is kept: the native side forgets it when returning it (lost, a later wait
                # raised "unknown op id" and the request could never be collected)
                results.clear()
                results.extend(map(self._backend.wait, (self._op_id,), (slice_s,)))
                if results[0] is not None or (deadline is not None and remaining(deadline) == 0):
                    break
        finally:
            if results and results[0] is not None:
                self._record(results[0])
        if results[0] is None:
            raise TimeoutError(f"transfer of {self.nbytes} bytes to/from {self.path} still running")

    def _record(self, result: tuple) -> None:
        self._collected = True
        err, operation, path, offset, detail, direct = result
        try:
            if err:
                self._error = os_error(err, operation, path, offset, detail)
                return
            if direct is False and not path.startswith("<fd "):  # (None: the engine never asks for O_DIRECT;
                # a caller's descriptor is used as opened)
                _warn_buffered(path)
            if self._finish is not None:
                self._finish()
        except BaseException as e:  # a validation failure or a device copy error belongs to this request
            self._error = e
        finally:
            if self._error is not None and self._created is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._created)
            self._created = None
            self._keep_alive = ()
            self._finish = None
            if self._owned_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._owned_fd)
                self._owned_fd = -1
            forget = self._on_collected() if self._on_collected is not None else None
            if forget is not None:  # pending until its buffers are released: see _close_live_handles
                forget(self._op_id)

    def drop_descriptor(self) -> None:
        """Close this process's copy of the caller's descriptor the transfer uses.

        For a forked child: the transfer runs in the parent, with the parent's copy.
        """
        if self._owned_fd >= 0:
            with contextlib.suppress(OSError):  # a descriptor of this process's only: nothing is lost if it is gone
                os.close(self._owned_fd)
            self._owned_fd = -1

    def __enter__(self) -> "Request":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.wait()
        else:  # already failing: make sure the buffers outlive the IO, without masking the first error
            try:
                self.wait()
            except Exception:  # the block's own exception is the one raised; this one is its consequence
                pass


def _warn_buffered(path: str) -> None:
    folder = str(Path(path).parent)
    if folder not in _warned_buffered:
        _warned_buffered.add(folder)
        warnings.warn(
            f"deepoffload: the filesystem of {folder} refuses O_DIRECT; using buffered IO there "
            f"(correct, but through the page cache)",
            RuntimeWarning,
            stacklevel=4,
        )


def _count_fork() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)
