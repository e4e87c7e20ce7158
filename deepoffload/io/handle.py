"""``AsyncIOHandle``: asynchronous reads and writes of tensors to files, returning ``Request`` objects.

Python validates tensors and keeps them (and any staging buffer) alive until their transfer is collected; the
engine the registry resolves (``deepoffload.io.engines``) opens the backend that does the IO: for a native engine the
native handle, on its own threads without the GIL. Each failure comes back as (errno, operation, path, offset), which
becomes an ``OSError`` here.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import os
import threading
import weakref
from typing import Any, Callable, Iterable, cast

import torch

from ..config import AioConfig
from ..errors import ClosedError, ValidationError
from . import accelerator
from .buffers import aligned_empty
from .engines import FSYNC, TRUNCATE, resolve_engine
from .inputs import FileRef, byte_view, check_tensor
from .request import Request, os_error
from .staging import DeviceStager

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1  # what the native op's integer arguments can hold
_live_handles: "weakref.WeakSet[AsyncIOHandle]" = weakref.WeakSet()


class AsyncIOHandle:
    """Reads and writes tensors to files with the async-IO op.

    Any contiguous CPU tensor works, at any file offset; page-aligned buffers (``aligned_empty``) skip the bounce
    copy. Tensors of the current accelerator go through page-locked host memory: ``read``/``write`` in chunks with
    the device copy overlapping the file IO (``DeviceStager``), ``read_async``/``write_async`` through one host
    buffer of the tensor's size. A write from offset 0 leaves the file exactly the tensor's size unless
    ``truncate=False``. Used as a context manager, the handle waits for every transfer (when the block succeeds) and
    closes.

    Args:
        config: The settings (an ``AioConfig``; default: ``AioConfig.from_env()``).
        **overrides: Settings that replace ``config``'s (``block_size``, ``queue_depth``, ``intra_op_parallelism``
            (alias ``thread_count``), ``single_submit``, ``overlap_events``, ``engine``).

    Raises:
        ConfigError: When an override's key or value is not accepted, or no registered engine has the name asked
            for (a ``ValueError``).
        ValueError: When ``block_size``, ``queue_depth`` or ``intra_op_parallelism`` is larger than the native op
            can hold.
        OSError: When the engine asked for (or, for ``"auto"``, every registered engine) is not usable here: not
            compiled into the native op, or failing its self-test.

    Examples:
        >>> import torch, deepoffload
        >>> tensor = torch.arange(1024, dtype=torch.float32)
        >>> back = torch.empty_like(tensor)
        >>> with deepoffload.AsyncIOHandle(queue_depth=8) as handle:
        ...     handle.write(tensor, "tensor.bin")
        ...     handle.read(back, "tensor.bin")
        4096
        4096
        >>> torch.equal(tensor, back)
        True
    """

    def __init__(self, config: AioConfig | None = None, **overrides: Any):
        self.config = AioConfig.from_dict(overrides, base=config) if overrides or config is None else config
        self._engine = resolve_engine(self.config.engine)
        self.engine = self._engine.name  # the engine used (``auto`` resolved)
        c = self.config
        for key, limit in (("block_size", INT64_MAX), ("queue_depth", INT32_MAX), ("intra_op_parallelism", INT32_MAX)):
            if getattr(c, key) > limit:  # the native op would refuse it with an unreadable TypeError
                raise ValueError(
                    f"{key}={getattr(c, key)} is out of range; use a value like the default ({getattr(AioConfig, key)})"
                )
        self._backend = self._open_backend()
        self._pending: dict[int, Request] = {}
        self._pending_lock = threading.Lock()
        self._closed = False
        self._stager = None
        _live_handles.add(self)

    def _open_backend(self):
        c = self.config
        return self._engine.open(
            block_size=c.block_size,
            queue_depth=c.queue_depth,
            single_submit=c.single_submit,
            overlap_events=c.overlap_events,
            intra_op_parallelism=c.intra_op_parallelism,
        )

    def _after_fork_in_child(self) -> None:
        """Let go of the parent's native handle in a forked child; the handle gets a fresh one on first use.

        The native handle's threads stayed in the parent (and its locks may be held), so it is never touched here, not
        even destroyed (its destructor would wait for them). The parent's transfers are the parent's: waiting for one
        here raises ``UnsupportedError`` (a ``RuntimeError``).
        """
        if self._backend is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._backend))  # leaked on purpose, see above
            self._backend = None
        for request in self._pending.values():  # this process's copies of descriptors the parent's transfers use
            request.drop_descriptor()
        self._pending = {}
        self._pending_lock = threading.Lock()

    # -- transfers --------------------------------------------------------------------------------------------
    def read_async(self, tensor: torch.Tensor, file: FileRef, offset: int = 0) -> Request:
        """Start reading ``tensor.nbytes`` bytes at ``offset`` of ``file`` into ``tensor``.

        Reading past the end of the file is an error (ENODATA, raised by the request's ``wait``), never a silent hole.
        Arguments are checked before any IO: ``TypeError`` for a tensor or file of the wrong type, ``ValueError`` for
        a tensor whose bytes cannot be read into (not contiguous, sparse, quantized, on another device) or an offset
        or descriptor out of range, ``ClosedError`` once the handle is closed.

        Args:
            tensor: A contiguous CPU tensor, or one of the current accelerator (read through one page-locked host
                buffer of its size, copied to it when the read completes).
            file: A path, or an open descriptor (the transfer uses its own copy of it).
            offset: The file offset to read from (bytes).

        Returns:
            The ``Request`` of the read; its ``wait()`` returns the bytes read.
        """
        check_tensor(tensor, "read", filled=True)
        if not tensor.is_inference():  # an in-place change, as torch's copy_ counts it: a backward that saved this
            torch.autograd.graph.increment_version(tensor)  # tensor refuses instead of using the new bytes
        finish = None
        target = tensor
        acc = accelerator.current()
        if acc.is_device_tensor(tensor):  # the whole tensor through one page-locked buffer, copied on completion
            target = aligned_empty(tensor.numel(), tensor.dtype)
            finish = lambda: acc.synchronize(acc.copy(tensor.view(-1), target.view(-1), None))  # noqa: E731
        return self._submit(False, target, file, offset, 0, (tensor, target), finish)

    def write_async(
        self, tensor: torch.Tensor, file: FileRef, offset: int = 0, *, truncate: bool | None = None, fsync: bool = False
    ) -> Request:
        """Start writing ``tensor``'s bytes at ``offset`` of ``file``.

        Arguments are checked before any IO: ``TypeError`` for a tensor or file of the wrong type, ``ValueError`` for
        a tensor whose bytes cannot be written (not contiguous, sparse, quantized, on another device) or an offset or
        descriptor out of range, ``ClosedError`` once the handle is closed.

        Args:
            tensor: A contiguous CPU tensor, or one of the current accelerator (copied to one page-locked host buffer
                of its size first).
            file: A path (created when missing), or an open descriptor (the transfer uses its own copy of it).
            offset: The file offset to write at (bytes).
            truncate: Cut the file to end where this write ends (default: ``offset == 0``).
            fsync: Make the data durable before the request completes.

        Returns:
            The ``Request`` of the write; its ``wait()`` returns the bytes written. When the write fails to a path that
            did not exist when it was submitted, the file it created is removed before ``wait()`` raises (do not
            write the same new path from another request meanwhile).
        """
        check_tensor(tensor, "write")
        source = tensor
        acc = accelerator.current()
        if acc.is_device_tensor(tensor):  # the whole tensor copied to one page-locked buffer first
            source = aligned_empty(tensor.numel(), tensor.dtype)
            acc.synchronize(acc.copy(source.view(-1), tensor.view(-1), None))
        flags = (TRUNCATE if (offset == 0 if truncate is None else truncate) else 0) | (FSYNC if fsync else 0)
        created = (
            os.fsdecode(file) if isinstance(file, (str, bytes, os.PathLike)) and not os.path.lexists(file) else None
        )
        return self._submit(True, source, file, offset, flags, (tensor, source), None, created)

    def read(self, tensor: torch.Tensor, file: FileRef, offset: int = 0, *, validate: bool = False) -> int:
        """Read ``tensor``'s bytes from ``offset`` of ``file`` into it and wait.

        An accelerator tensor is staged in chunks through two host buffers (``DeviceStager``). A failed read raises
        its ``OSError`` (errno, operation, path and offset in the message; ENODATA past the end of the file);
        ``validate`` raises ``ValidationError`` (an ``OSError``) when the file's bytes differ from the tensor's.

        Args:
            tensor: A contiguous CPU tensor or one of the current accelerator.
            file: A path or an open descriptor.
            offset: The file offset to read from (bytes).
            validate: Compare the tensor afterwards with Python's own read of the file.

        Returns:
            The bytes read.
        """
        if isinstance(tensor, torch.Tensor) and accelerator.current().is_device_tensor(tensor):
            nbytes = self._device_stager().read(tensor, file, offset)
        else:
            nbytes = self.read_async(tensor, file, offset).wait()
        if validate:
            _validate(tensor, file, offset)
        return nbytes

    def write(
        self,
        tensor: torch.Tensor,
        file: FileRef,
        offset: int = 0,
        *,
        validate: bool = False,
        truncate: bool | None = None,
        fsync: bool = False,
    ) -> int:
        """Write ``tensor``'s bytes at ``offset`` of ``file`` and wait.

        An accelerator tensor is staged in chunks through two host buffers (``DeviceStager``). A write that fails
        (full disk, validation) to a path that did not exist before the call leaves no file there (do not write the
        same new path from another thread meanwhile).

        Args:
            tensor: A contiguous CPU tensor or one of the current accelerator.
            file: A path (created when missing) or an open descriptor.
            offset: The file offset to write at (bytes).
            validate: Re-read the file afterwards and compare it with the tensor.
            truncate: Cut the file to end where this write ends (default: ``offset == 0``).
            fsync: Make the data durable before returning.

        Returns:
            The bytes written.

        Raises:
            OSError: When the write fails (errno, operation, path and offset in the message), or, as
                ``ValidationError``, when ``validate`` finds the file's bytes differ from the tensor's.
        """
        new = file if isinstance(file, (str, bytes, os.PathLike)) and not os.path.lexists(file) else None
        try:
            if isinstance(tensor, torch.Tensor) and accelerator.current().is_device_tensor(tensor):
                nbytes = self._device_stager().write(tensor, file, offset, truncate=truncate, fsync=fsync)
            else:
                nbytes = self.write_async(tensor, file, offset, truncate=truncate, fsync=fsync).wait()
            if validate:
                _validate(tensor, file, offset)
        except OSError:
            if new is not None:
                with contextlib.suppress(OSError):
                    os.unlink(new)
            raise
        return nbytes

    def _device_stager(self):
        """This handle's ``DeviceStager`` (created on first use of an accelerator tensor)."""
        with self._pending_lock:
            if self._stager is None:
                self._stager = DeviceStager(self)
            return self._stager

    def _submit(
        self,
        write: bool,
        buffer: torch.Tensor,
        file: FileRef,
        offset: int,
        flags: int,
        keep_alive: tuple,
        finish: Callable[[], None] | None,
        created: str | None = None,
    ) -> Request:
        if self._closed:
            raise ClosedError("this AsyncIOHandle is closed")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"file offset must be a non-negative integer (bytes), got {offset!r}")
        fd, path = _file_ref(file)
        nbytes = buffer.numel() * buffer.element_size()
        if offset > INT64_MAX - nbytes:
            raise ValueError(f"file offset {offset} + {nbytes} bytes is past the largest file offset (2**63 - 1)")
        if fd >= 0:  # a copy, so that the caller closing theirs (and the number's reuse) cannot redirect the transfer
            try:
                fd = os.dup(fd)
            except OSError as e:
                err = cast(int, e.errno)  # os.dup's OSError always carries its errno
                raise os_error(err, "open", path, offset, f"descriptor {path[4:-1]} is not usable") from None
        try:
            with self._pending_lock:
                if self._backend is None:  # first use in a forked child
                    self._backend = self._open_backend()
                op_id = self._backend.submit(write, buffer.data_ptr(), nbytes, os.fsencode(path), fd, offset, flags)
                request = Request(
                    self._backend,
                    op_id,
                    nbytes,
                    path,
                    keep_alive,
                    finish,
                    owned_fd=fd,
                    created=created,
                    on_collected=weakref.WeakMethod(self._forget),
                )
                self._pending[op_id] = request
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return request

    def _forget(self, op_id: int) -> None:
        with self._pending_lock:
            self._pending.pop(op_id, None)

    def wait_all(self) -> int:
        """Wait for every transfer in flight, even when some fail.

        If any failed, the first error (an ``OSError``) is raised after all have finished: no transfer is left running
        behind an exception.

        Returns:
            How many transfers finished.
        """
        with self._pending_lock:
            requests = list(self._pending.values())
        first_error = wait_each(requests)
        if first_error is not None:
            raise first_error
        return len(requests)

    def pending(self) -> int:
        """Transfers submitted and not yet waited for."""
        with self._pending_lock:
            return len(self._pending)

    # -- lifetime ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish every transfer in flight and stop the handle's threads; closing again does nothing.

        Errors of transfers nobody waited for are still raised by their ``Request.wait()``.
        """
        if not self._closed:
            self._closed = True
            if self._backend is not None:
                self._backend.close()

    def __enter__(self) -> "AsyncIOHandle":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.wait_all()
        finally:
            self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):  # (an __init__ that raised left nothing to close)
            self.close()  # an error here reaches sys.unraisablehook, as any in __del__

    # -- settings ---------------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Bytes per IO request (``config.block_size``)."""
        return self.config.block_size

    @property
    def queue_depth(self) -> int:
        """Requests kept in flight per thread (``config.queue_depth``)."""
        return self.config.queue_depth

    @property
    def intra_op_parallelism(self) -> int:
        """Threads that share one transfer (``config.intra_op_parallelism``)."""
        return self.config.intra_op_parallelism

    def __repr__(self) -> str:
        c = self.config
        return (
            f"AsyncIOHandle(engine={self.engine!r}, block_size={c.block_size}, queue_depth={c.queue_depth}, "
            f"intra_op_parallelism={c.intra_op_parallelism}, single_submit={c.single_submit}, "
            f"overlap_events={c.overlap_events})"
        )


def wait_each(transfers: Iterable) -> OSError | None:
    """Wait for every transfer even when some fail, for callers that must not leave one running behind an exception.

    Args:
        transfers: Anything with ``wait()``: requests, swaps.

    Returns:
        The first ``OSError`` a wait raised, or None.
    """
    first_error = None
    for transfer in transfers:
        try:
            transfer.wait()
        except OSError as e:
            first_error = first_error or e
    return first_error


def _file_ref(file: FileRef) -> tuple[int, str]:
    if isinstance(file, bool):
        raise TypeError("file: expected a path or a file descriptor, got a bool")
    if isinstance(file, int):
        if not 0 <= file <= INT32_MAX:
            raise ValueError(f"file descriptor must be an open descriptor (0 to {INT32_MAX}), got {file}")
        return file, f"<fd {file}>"
    if isinstance(file, (str, bytes, os.PathLike)):
        path = os.fspath(file)  # str or bytes, as open() takes them
        if not path:
            raise ValueError(f"file: expected a non-empty path, got {file!r}")
        if ("\0" if isinstance(path, str) else b"\0") in path:  # the OS would see a different (shorter) name
            raise ValueError(f"file: embedded null byte in path {path!r}")
        return -1, os.fsdecode(path)
    raise TypeError(f"file: expected a path or a file descriptor, got {type(file).__name__}")


def _validate(tensor: torch.Tensor, file: FileRef, offset: int) -> None:
    """Compare the tensor's bytes with the file's, read by Python itself (no page-cache tricks)."""
    expected = byte_view(tensor.detach().cpu())
    nbytes = expected.numel()
    if isinstance(file, int):
        data = os.pread(file, nbytes, offset)
        path: str | bytes = f"<fd {file}>"
    else:
        path = os.fspath(file)
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
    if len(data) != nbytes or (
        nbytes and not torch.equal(expected, torch.frombuffer(bytearray(data), dtype=torch.uint8))
    ):
        raise ValidationError(
            errno.EIO, f"validation failed: the {nbytes} bytes at offset {offset} differ from the tensor's", path
        )


def _after_fork_in_child() -> None:
    for handle in list(_live_handles):
        handle._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_live_handles() -> None:
    """At interpreter exit, let transfers in flight finish before the buffers they use are torn down.

    They are collected here (or this waits for the thread collecting one) so that their tensors are freed before
    finalization: torch aborts the process when a daemon thread frees a tensor once finalization has begun.
    """
    for handle in list(_live_handles):
        try:
            handle.wait_all()
        except Exception:
            pass  # reported to whoever waits for those requests
        try:
            handle.close()
        except Exception:  # the process is ending and no caller is left to tell: the other handles must still close
            pass
