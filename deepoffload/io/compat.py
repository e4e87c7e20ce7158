"""The DeepSpeed-shaped surface: ``AsyncIOBuilder().load().aio_handle(...)`` with DeepSpeed's methods, argument
orders and return values, so code written for ``deepspeed.ops.op_builder.AsyncIOBuilder`` runs after changing only
its import. Where DeepSpeed returns -1 or aborts, these raise.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..config import AioConfig
from .buffers import PAGE_SIZE, aligned_empty, is_pinned
from .handle import AsyncIOHandle, FileRef

_D = AioConfig  # the one set of defaults


class aio_handle:  # noqa: N801  (DeepSpeed's name)
    """DeepSpeed's ``aio_handle``: synchronous calls return 1, asynchronous ones 0, ``wait()`` the number of
    asynchronous operations that completed (0 when none were pending)."""

    def __init__(self, block_size: int = _D.block_size, queue_depth: int = _D.queue_depth,
                 single_submit: bool = _D.single_submit, overlap_events: bool = _D.overlap_events,
                 intra_op_parallelism: int = _D.intra_op_parallelism):
        self._handle = AsyncIOHandle(AioConfig.from_dict(dict(
            block_size=block_size, queue_depth=queue_depth, single_submit=single_submit,
            overlap_events=overlap_events, intra_op_parallelism=intra_op_parallelism)))

    # getters
    def get_block_size(self) -> int:
        return self._handle.config.block_size

    def get_queue_depth(self) -> int:
        return self._handle.config.queue_depth

    def get_single_submit(self) -> bool:
        return self._handle.config.single_submit

    def get_overlap_events(self) -> bool:
        return self._handle.config.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._handle.config.intra_op_parallelism

    get_thread_count = get_intra_op_parallelism

    def get_alignment(self) -> int:
        return PAGE_SIZE

    # transfers
    def read(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, validate, False, file_offset)

    def write(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, validate, False, file_offset)

    def pread(self, buffer: torch.Tensor, filename: FileRef, validate: bool, async_op: bool,
              file_offset: int = 0) -> int:
        if async_op:
            self._handle.read_async(buffer, filename, file_offset)
            return 0
        self._handle.read(buffer, filename, file_offset, validate=validate)
        return 1

    def pwrite(self, buffer: torch.Tensor, filename: FileRef, validate: bool, async_op: bool,
               file_offset: int = 0) -> int:
        if async_op:
            self._handle.write_async(buffer, filename, file_offset, truncate=False)
            return 0
        self._handle.write(buffer, filename, file_offset, validate=validate, truncate=False)
        return 1

    def sync_pread(self, buffer: torch.Tensor, filename: FileRef, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: FileRef, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: FileRef, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: FileRef, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, False, True, file_offset)

    def wait(self) -> int:
        return self._handle.wait_all()

    # buffers
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return aligned_empty(int(num_elem), example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """The memory is unlocked and returned when the last reference to it goes; this drops the handle's
        interest (it keeps none) and reports whether it was a locked tensor."""
        return is_pinned(tensor)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return is_pinned(tensor)


class CompatModule:
    """What ``AsyncIOBuilder().load()`` returns: ``aio_handle`` plus the native module's functions."""

    aio_handle = aio_handle

    def __init__(self, native_module: ModuleType):
        self._native = native_module

    def __getattr__(self, name: str):
        return getattr(self._native, name)
