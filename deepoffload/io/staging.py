"""``DeviceStager``: accelerator tensors to and from files through two page-locked, aligned host buffers.

Read: chunk k+1 is read from storage into one buffer while chunk k is copied from the other to the device.
Write: chunk k+1 is copied from the device into one buffer while chunk k is written to the file from the other.
The file side is ``StagedReader``/``StagedWriter`` (``staged_file``), which refill a buffer only after the file
transfer that used it has completed; each device copy completes before its buffer goes back to them.
Copies run on a side stream that first waits for the device's current stream; both calls return only once every
copy has completed, so the tensor is ready (or its bytes are on storage) for any stream.
"""

from __future__ import annotations

import threading

import torch

from . import accelerator
from .buffers import PAGE_SIZE
from .inputs import FileRef, byte_view, check_tensor
from .staged_file import StagedReader, StagedWriter, StagingPool, Transfers

DEFAULT_CHUNK_BYTES = 8 << 20  # bytes per host buffer; two are used


class DeviceStager:
    """Reads and writes tensors of the current accelerator through two host buffers.

    One transfer at a time (calls from several threads queue). Host tensors do not need it: use ``handle`` directly.

    Args:
        handle: The handle that does the file IO.
        chunk_bytes: The size of each host buffer (rounded up to the page size).

    Raises:
        ValueError: When ``chunk_bytes`` is not a positive integer.
    """

    def __init__(self, handle: Transfers, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive integer (bytes), got {chunk_bytes!r}")
        self.handle = handle
        self.chunk_bytes = -(-chunk_bytes // PAGE_SIZE) * PAGE_SIZE
        self._lock = threading.Lock()
        self._pool: StagingPool | None = None
        self._pool_for: accelerator.Accelerator | None = None
        self._streams: dict[torch.device, torch.Stream | None] = {}

    def read(self, tensor: torch.Tensor, file: FileRef, offset: int = 0) -> int:
        """Read ``tensor``'s bytes from ``offset`` of ``file`` into it.

        On error (an ``OSError`` naming path and offset) the tensor's contents are unspecified. A tensor that is not
        on the current accelerator is a ``ValueError``.

        Args:
            tensor: A contiguous tensor of the current accelerator.
            file: A path or an open descriptor.
            offset: The file offset to read from (bytes).

        Returns:
            The bytes read.
        """
        acc = self._device_tensor(tensor, "read")
        dst = byte_view(tensor)
        nbytes = dst.numel()
        with self._lock:
            pool, stream = self._setup(acc, tensor.device)
            reader = StagedReader(self.handle, file, offset, offset + nbytes, pool=pool, depth=2)
            try:
                for k in range(reader.chunk_count):
                    host = reader.get(k)  # chunk k is in a host buffer; chunk k+1 is being read into the other
                    start = k * self.chunk_bytes
                    _copy(acc, dst[start : start + host.numel()], host, stream)
            finally:
                reader.close()  # waits for any read still in flight
        return nbytes

    def write(
        self, tensor: torch.Tensor, file: FileRef, offset: int = 0, *, truncate: bool | None = None, fsync: bool = False
    ) -> int:
        """Write ``tensor``'s bytes at ``offset`` of ``file``.

        The tensor is only read, so it is intact whatever happens. A failed write raises its ``OSError``; a tensor
        that is not on the current accelerator is a ``ValueError``.

        Args:
            tensor: A contiguous tensor of the current accelerator.
            file: A path or an open descriptor.
            offset: The file offset to write at (bytes).
            truncate: Cut the file to end where this write ends (default: ``offset == 0``).
            fsync: Make the data durable before returning.

        Returns:
            The bytes written.
        """
        acc = self._device_tensor(tensor, "write")
        src = byte_view(tensor)
        nbytes = src.numel()
        truncate = offset == 0 if truncate is None else truncate
        if not nbytes:  # nothing to stage; the handle still truncates (or creates) the file as asked
            empty = torch.empty(0, dtype=torch.uint8)
            return self.handle.write_async(empty, file, offset, truncate=truncate, fsync=fsync).wait()
        with self._lock:
            pool, stream = self._setup(acc, tensor.device)
            writer = StagedWriter(self.handle, file, offset, pool=pool, count=2)
            try:
                for start in range(0, nbytes, self.chunk_bytes):
                    length = min(self.chunk_bytes, nbytes - start)
                    host = writer.reserve()[:length]  # waits for the write of chunk k-2 that used this buffer
                    _copy(acc, host, src[start : start + length], stream)  # chunk k-1 is being written
                    writer.commit(length)
                    last = start + length == nbytes  # the last chunk carries the truncation and the fsync
                    writer.submit(truncate=truncate and last, fsync=fsync and last)
                writer.drain()
            finally:
                writer.close()  # waits for any write still in flight
        return nbytes

    # -- internals ------------------------------------------------------------------------------------------
    @staticmethod
    def _device_tensor(tensor: torch.Tensor, what: str) -> accelerator.Accelerator:
        check_tensor(tensor, what, filled=what == "read")  # a read fills it: the advice differs
        acc = accelerator.current()
        if not acc.is_device_tensor(tensor):
            raise ValueError(
                f"{what}: DeviceStager moves {acc.name} tensors; a tensor on {tensor.device} goes "
                f"through AsyncIOHandle directly"
            )
        return acc

    def _setup(self, acc: accelerator.Accelerator, device: torch.device) -> tuple[StagingPool, torch.Stream | None]:
        """The pool of two host buffers and the side stream for ``device``, made to wait for its current stream.

        The pool is allocated on first use, page-locked for ``acc`` (again when the accelerator changed).

        Args:
            acc: The current accelerator.
            device: The device of the tensor being staged.

        Returns:
            The pool and the side stream (None: copies are synchronous).
        """
        if self._pool is None or self._pool_for is not acc:  # (no pool yet: no accelerator either)
            self._pool, self._pool_for, self._streams = StagingPool(self.chunk_bytes, keep=2), acc, {}
        if device not in self._streams:
            self._streams[device] = acc.new_stream(device)
        stream = self._streams[device]
        acc.wait_for_current(stream, device)
        return self._pool, stream


def _copy(acc: accelerator.Accelerator, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
    """Copy on ``stream`` and wait for it.

    After a failed wait, wait once more (errors dropped) so that the copy does not run later, into or out of a host
    buffer that has gone back to the pool.
    """
    event = acc.copy(dst, src, stream)
    try:
        acc.synchronize(event)
    except BaseException:
        try:
            acc.synchronize(event)
        except Exception:  # only waiting for the copy to end; the first failure is the one raised below
            pass
        raise
