"""The DeepSpeed-shaped surface: ``AsyncIOBuilder().load().aio_handle(...)`` as DeepSpeed 0.19.8 has it.

Its methods, argument names, defaults and return values are DeepSpeed's, so code written for
``deepspeed.ops.op_builder.AsyncIOBuilder`` runs after changing only its import. Where DeepSpeed returns -1 or
aborts, these raise (docs/deepspeed-differences.md lists every deliberate difference). Writes never shorten a file:
DeepSpeed opens for writing without ``O_TRUNC`` and writes files in pieces.
"""

from __future__ import annotations

import contextlib
import threading
from types import ModuleType

import torch

from ..config import AioConfig
from .compat_args import MISSING, async_flag, file_argument, required
from .handle import AsyncIOHandle
from .inputs import FileRef, check_tensor
from .pin_memory import free_locked, new_locked, pinned_or_locked

# DeepSpeed's aio_handle constructor defaults (py_ds_aio.cpp).
DS_BLOCK_SIZE, DS_QUEUE_DEPTH, DS_INTRA_OP_PARALLELISM = 1 << 20, 128, 1
DS_SINGLE_SUBMIT, DS_OVERLAP_EVENTS = False, False
O_DIRECT_ALIGNMENT = 512  # DeepSpeed's get_alignment() is this times intra_op_parallelism
MIN_IO_BLOCK = 4096  # smaller block sizes are accepted and reported, IO uses this


class aio_handle:  # noqa: N801  (DeepSpeed's name)
    """DeepSpeed's ``aio_handle``, on an ``AsyncIOHandle``.

    Asynchronous calls return 0; synchronous ones wait for their own operation and every pending asynchronous one and
    return how many completed (1 when none were pending); ``wait()`` the number of asynchronous operations that
    completed (0 when none were pending). A failed transfer raises its ``OSError`` instead of returning -1.

    Args:
        block_size: Bytes per IO request, as ``get_block_size`` reports it (IO uses at least 4096).
        queue_depth: Requests kept in flight per thread.
        single_submit: Submit one request per system call instead of batches.
        overlap_events: Refill the queue as completions arrive instead of waiting for a whole batch.
        intra_op_parallelism: Threads that share one transfer.
        engine: One of deepoffload's engines (not in DeepSpeed); by default ``DEEPOFFLOAD_AIO_ENGINE`` or ``auto``.

    Raises:
        ValueError: When ``block_size`` is not a positive integer (another setting that is not accepted raises
            ``ConfigError``, also a ``ValueError``).
    """

    def __init__(
        self,
        block_size: int = DS_BLOCK_SIZE,
        queue_depth: int = DS_QUEUE_DEPTH,
        single_submit: bool = DS_SINGLE_SUBMIT,
        overlap_events: bool = DS_OVERLAP_EVENTS,
        intra_op_parallelism: int = DS_INTRA_OP_PARALLELISM,
        *,
        engine: str | None = None,
    ):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive number of bytes, got {block_size!r}")
        self._block_size = block_size
        settings: dict[str, object] = dict(
            block_size=max(block_size, MIN_IO_BLOCK),
            queue_depth=queue_depth,
            single_submit=single_submit,
            overlap_events=overlap_events,
            intra_op_parallelism=intra_op_parallelism,
        )
        if engine is not None:
            settings["engine"] = engine
        self._handle = AsyncIOHandle(AioConfig.from_dict(settings, base=AioConfig.from_env()))
        # DeepSpeed's handle mutex: a call submits (and a synchronous one waits and counts) with no other thread's
        # call in between, so two threads' synchronous calls on one handle each return 1, not each other's count.
        self._mutex = threading.Lock()

    # getters
    def get_block_size(self) -> int:
        """The block size given (IO underneath uses at least 4096-byte blocks, so it stays aligned)."""
        return self._block_size

    def get_queue_depth(self) -> int:
        """The queue depth (requests kept in flight per thread)."""
        return self._handle.config.queue_depth

    def get_single_submit(self) -> bool:
        """Whether requests are submitted one per system call."""
        return self._handle.config.single_submit

    def get_overlap_events(self) -> bool:
        """Whether the queue is refilled as completions arrive."""
        return self._handle.config.overlap_events

    def get_intra_op_parallelism(self) -> int:
        """The number of threads that share one transfer."""
        return self._handle.config.intra_op_parallelism

    def get_alignment(self) -> int:
        """DeepSpeed's alignment: 512 bytes times intra_op_parallelism (its checkpoint writer sizes buffers with it).

        deepoffload itself takes any size and offset.

        Returns:
            The alignment in bytes.
        """
        return O_DIRECT_ALIGNMENT * self._handle.config.intra_op_parallelism

    # transfers
    def read(
        self, buffer: torch.Tensor, filename=MISSING, validate=MISSING, file_offset: int = 0, *, fd: int | None = None
    ) -> int:
        """Read ``buffer``'s bytes from the file, then wait for every pending asynchronous operation.

        Args:
            buffer: A contiguous CPU (or current-accelerator) tensor.
            filename: The file's path (required unless ``fd`` is given).
            validate: Compare the tensor with Python's own read of the file afterwards (required).
            file_offset: The file offset (bytes).
            fd: An open descriptor, instead of ``filename``.

        Returns:
            1 plus the pending asynchronous operations it waited for.
        """
        return self._transfer(
            False,
            buffer,
            file_argument(filename, fd, "read"),
            required(validate, "validate", "read"),
            False,
            file_offset,
        )

    def write(
        self, buffer: torch.Tensor, filename=MISSING, validate=MISSING, file_offset: int = 0, *, fd: int | None = None
    ) -> int:
        """Write ``buffer``'s bytes to the file, then wait for every pending asynchronous operation.

        Args:
            buffer: A contiguous CPU (or current-accelerator) tensor.
            filename: The file's path (required unless ``fd`` is given).
            validate: Re-read the file afterwards and compare it with the tensor (required).
            file_offset: The file offset (bytes).
            fd: An open descriptor, instead of ``filename``.

        Returns:
            1 plus the pending asynchronous operations it waited for.
        """
        return self._transfer(
            True,
            buffer,
            file_argument(filename, fd, "write"),
            required(validate, "validate", "write"),
            False,
            file_offset,
        )

    def pread(
        self,
        buffer: torch.Tensor,
        filename=MISSING,
        validate=MISSING,
        async_op=MISSING,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        **kwargs,
    ) -> int:
        """Read ``buffer``'s bytes from the file, asynchronously or not.

        Args:
            buffer: A contiguous CPU (or current-accelerator) tensor.
            filename: The file's path (required unless ``fd`` is given).
            validate: Compare the tensor with Python's own read of the file afterwards (required).
            async_op: Return at once (0) instead of waiting (required); DeepSpeed names it ``async``, accepted as
                ``**{"async": ...}``.
            file_offset: The file offset (bytes).
            fd: An open descriptor, instead of ``filename``.
            **kwargs: Only ``async`` (DeepSpeed's name of ``async_op``).

        Returns:
            0 when asynchronous; else 1 plus the pending asynchronous operations it waited for.
        """
        return self._transfer(
            False,
            buffer,
            file_argument(filename, fd, "pread"),
            required(validate, "validate", "pread"),
            async_flag(async_op, kwargs, "pread"),
            file_offset,
        )

    def pwrite(
        self,
        buffer: torch.Tensor,
        filename=MISSING,
        validate=MISSING,
        async_op=MISSING,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        **kwargs,
    ) -> int:
        """Write ``buffer``'s bytes to the file, asynchronously or not.

        Args:
            buffer: A contiguous CPU (or current-accelerator) tensor.
            filename: The file's path (required unless ``fd`` is given).
            validate: Re-read the file afterwards and compare it with the tensor (required).
            async_op: Return at once (0) instead of waiting (required); DeepSpeed names it ``async``, accepted as
                ``**{"async": ...}``.
            file_offset: The file offset (bytes).
            fd: An open descriptor, instead of ``filename``.
            **kwargs: Only ``async`` (DeepSpeed's name of ``async_op``).

        Returns:
            0 when asynchronous; else 1 plus the pending asynchronous operations it waited for.
        """
        return self._transfer(
            True,
            buffer,
            file_argument(filename, fd, "pwrite"),
            required(validate, "validate", "pwrite"),
            async_flag(async_op, kwargs, "pwrite"),
            file_offset,
        )

    def sync_pread(self, buffer: torch.Tensor, filename=MISSING, file_offset: int = 0, *, fd: int | None = None) -> int:
        """``pread`` without validation, waiting.

        Args:
            buffer: A contiguous CPU (or current-accelerator) tensor.
            filename: The file's path (required unless ``fd`` is given).
            file_offset: The file offset (bytes).
            fd: An open descriptor, instead of ``filename``.

        Returns:
            1 plus the pending asynchronous operations it waited for.
        """
        return self._transfer(False, buffer, file_argument(filename, fd, "sync_pread"), False, False, file_offset)

    def sync_pwrite(
        self, buffer: torch.Tensor, filename=MISSING, file_offset: int = 0, *, fd: int | None = None
    ) -> int:
        """``pwrite`` without validation, waiting.

        Args:
            buffer: A contiguous CPU (or current-accelerator) tensor.
            filename: The file's path (required unless ``fd`` is given).
            file_offset: The file offset (bytes).
            fd: An open descriptor, instead of ``filename``.

        Returns:
            1 plus the pending asynchronous operations it waited for.
        """
        return self._transfer(True, buffer, file_argument(filename, fd, "sync_pwrite"), False, False, file_offset)

    def async_pread(
        self, buffer: torch.Tensor, filename=MISSING, file_offset: int = 0, *, fd: int | None = None
    ) -> int:
        """``pread`` without validation, returning at once (``wait()`` collects it).

        Args:
            buffer: A contiguous CPU (or current-accelerator) tensor.
            filename: The file's path (required unless ``fd`` is given).
            file_offset: The file offset (bytes).
            fd: An open descriptor, instead of ``filename``.

        Returns:
            0.
        """
        return self._transfer(False, buffer, file_argument(filename, fd, "async_pread"), False, True, file_offset)

    def async_pwrite(
        self, buffer: torch.Tensor, filename=MISSING, file_offset: int = 0, *, fd: int | None = None
    ) -> int:
        """``pwrite`` without validation, returning at once (``wait()`` collects it).

        Args:
            buffer: A contiguous CPU (or current-accelerator) tensor.
            filename: The file's path (required unless ``fd`` is given).
            file_offset: The file offset (bytes).
            fd: An open descriptor, instead of ``filename``.

        Returns:
            0.
        """
        return self._transfer(True, buffer, file_argument(filename, fd, "async_pwrite"), False, True, file_offset)

    def _transfer(
        self, write: bool, buffer: torch.Tensor, file: FileRef, validate: bool, async_op: bool, file_offset: int
    ) -> int:
        with self._mutex:
            return self._transfer_locked(write, buffer, file, validate, async_op, file_offset)

    def _transfer_locked(
        self, write: bool, buffer: torch.Tensor, file: FileRef, validate: bool, async_op: bool, file_offset: int
    ) -> int:
        if async_op:
            if write:
                self._handle.write_async(buffer, file, file_offset, truncate=False)
            else:
                self._handle.read_async(buffer, file, file_offset)
            return 0
        try:
            if write:
                self._handle.write(buffer, file, file_offset, validate=bool(validate), truncate=False)
            else:
                self._handle.read(buffer, file, file_offset, validate=bool(validate))
        except Exception:
            with contextlib.suppress(Exception):  # still drain the pending ones, as below; this error is raised
                self._handle.wait_all()
            raise
        # Like DeepSpeed's, a synchronous call also waits for every pending asynchronous one and counts it: code
        # written for DeepSpeed uses their buffers next without calling wait() (DeepSpeed aborts when none pend).
        return 1 + self._handle.wait_all()

    def wait(self) -> int:
        """Wait for every pending asynchronous operation.

        Returns:
            How many completed (0 when none were pending).
        """
        with self._mutex:
            return self._handle.wait_all()

    # buffers
    def new_cpu_locked_tensor(self, num_elem: int, example_tenosr: torch.Tensor = MISSING, **kwargs) -> torch.Tensor:
        """A page-aligned, page-locked 1-D tensor of ``num_elem`` elements of the example's dtype.

        Args:
            num_elem: The number of elements.
            example_tenosr: A tensor of the dtype wanted (DeepSpeed's spelling; required).
            **kwargs: Only ``example_tensor``, accepted for ``example_tenosr``.

        Returns:
            The tensor (contents uninitialised).

        Raises:
            TypeError: When an unknown keyword argument is given.
        """
        if "example_tensor" in kwargs and example_tenosr is MISSING:
            example_tenosr = kwargs.pop("example_tensor")
        if kwargs:
            raise TypeError(f"aio_handle.new_cpu_locked_tensor() got unexpected keyword arguments {sorted(kwargs)}")
        return new_locked(num_elem, required(example_tenosr, "example_tenosr", "new_cpu_locked_tensor"))

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Unlock a tensor from ``new_cpu_locked_tensor``; its pages are unlocked now and ``is_pinned`` turns False.

        Unlike DeepSpeed, the memory itself is returned only when the last reference to it goes, so a tensor used
        after this call still holds its bytes.

        Args:
            tensor: The tensor to free.

        Returns:
            True for a tensor from ``new_cpu_locked_tensor`` not freed yet, else False.
        """
        check_tensor(tensor, "free_cpu_locked_tensor")
        return free_locked(tensor.data_ptr())

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is pinned by DeepSpeed's rule.

        Args:
            buffer: Any tensor (False for anything else).

        Returns:
            True when it is torch-pinned, or inside a live locked buffer of any handle (``aio_handle`` or
            ``pin_handle``: one process-wide registry, as DeepSpeed's pinned-tensor manager).
        """
        return pinned_or_locked(buffer)


def aio_read(
    buffer: torch.Tensor,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """DeepSpeed's module-level read of a whole file into ``buffer``.

    Args:
        buffer: A contiguous tensor of the file's size.
        filename: The file.
        block_size: As ``aio_handle``'s.
        queue_depth: As ``aio_handle``'s.
        single_submit: As ``aio_handle``'s.
        overlap_events: As ``aio_handle``'s.
        validate: Compare the tensor with Python's own read of the file afterwards.

    Returns:
        0.

    Raises:
        ValueError: When the file is not exactly ``buffer``'s size (DeepSpeed asserts this).
    """
    import os

    check_tensor(buffer, "aio_read", filled=True)
    size = os.stat(filename).st_size
    nbytes = buffer.numel() * buffer.element_size()
    if size != nbytes:
        raise ValueError(
            f"aio_read: '{filename}' has {size} bytes but the buffer has {nbytes}; pass a buffer of the file's size"
        )
    aio_handle(block_size, queue_depth, single_submit, overlap_events, 1).read(buffer, filename, validate)
    return 0


def aio_write(
    buffer: torch.Tensor,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """DeepSpeed's module-level write of ``buffer`` at offset 0 of ``filename`` (no truncation).

    Args:
        buffer: A contiguous tensor.
        filename: The file.
        block_size: As ``aio_handle``'s.
        queue_depth: As ``aio_handle``'s.
        single_submit: As ``aio_handle``'s.
        overlap_events: As ``aio_handle``'s.
        validate: Re-read the file afterwards and compare it with the tensor.

    Returns:
        0.
    """
    aio_handle(block_size, queue_depth, single_submit, overlap_events, 1).write(buffer, filename, validate)
    return 0


def deepspeed_memcpy(dest: torch.Tensor, src: torch.Tensor) -> int:
    """DeepSpeed's copy of ``src`` into ``dest``, for any dtype.

    DeepSpeed copies ``dest.size(0)`` floats whatever they are, and into a temporary copy when ``dest`` is not
    contiguous; here the element counts must match and ``dest`` itself is written.

    Args:
        dest: The tensor copied into.
        src: The tensor copied from, with as many elements as ``dest``.

    Returns:
        0.

    Raises:
        TypeError: When either is not a tensor.
        ValueError: When their element counts differ.
    """
    for name, t in (("dest", dest), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"deepspeed_memcpy: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dest.numel() != src.numel():
        raise ValueError(f"deepspeed_memcpy: dest has {dest.numel()} elements, src {src.numel()}; they must match")
    with torch.no_grad():
        dest.copy_(src.reshape(dest.shape))
    return 0


class CompatModule:
    """What ``AsyncIOBuilder().load()`` returns.

    DeepSpeed's ``aio_handle``, ``aio_read``, ``aio_write`` and ``deepspeed_memcpy``, plus the native module's
    functions.

    Args:
        native_module: The native async-IO module, whose attributes this passes through.
    """

    aio_handle = aio_handle
    aio_read = staticmethod(aio_read)
    aio_write = staticmethod(aio_write)
    deepspeed_memcpy = staticmethod(deepspeed_memcpy)

    def __init__(self, native_module: ModuleType):
        self._native = native_module

    def __getattr__(self, name: str):
        return getattr(self._native, name)
