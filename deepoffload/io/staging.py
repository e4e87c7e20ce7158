"""``DeviceStager``: accelerator tensors to and from files through two page-locked, aligned host buffers.

Read: chunk k+1 is read from storage into one buffer while chunk k is copied from the other to the device.
Write: chunk k+1 is copied from the device into one buffer while chunk k is written to the file from the other.
Each buffer (``_Slot``) is in one state: free, in file IO (a ``Request``) or in a device copy (an event); it is
refilled only from the free state, after the transfer that used it has completed, and every transition is checked.
Copies run on a side stream that first waits for the device's current stream; both calls return only once every
copy has completed, so the tensor is ready (or its bytes are on storage) for any stream.
"""

from __future__ import annotations

import enum
import threading

import torch

from . import accelerator
from .buffers import PAGE_SIZE, aligned_empty
from .handle import AsyncIOHandle, FileRef, Request, byte_view, check_tensor

DEFAULT_CHUNK_BYTES = 8 << 20  # bytes per host buffer; two are used


class _State(enum.Enum):
    FREE = "free"
    FILE_IO = "file IO"
    DEVICE_COPY = "device copy"


class _Slot:
    """One host buffer and the one transfer using it."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.state = _State.FREE
        self.request: Request | None = None
        self.event = None

    def _enter(self, state: _State) -> None:
        if self.state is not _State.FREE:  # a host buffer must never be refilled while a transfer uses it
            raise RuntimeError(f"deepoffload internal error: staging buffer reused for {state.value} while its "
                               f"{self.state.value} is in flight")
        self.state = state

    def start_io(self, request: Request) -> None:
        self._enter(_State.FILE_IO)
        self.request = request

    def start_copy(self, acc: accelerator.Accelerator, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        self._enter(_State.DEVICE_COPY)
        self.event = acc.copy(dst, src, stream)

    def finish(self, acc: accelerator.Accelerator) -> None:
        """Wait for the transfer in flight (if any); raise its error. The slot is free afterwards either way."""
        state, request, event = self.state, self.request, self.event
        self.state, self.request, self.event = _State.FREE, None, None
        if state is _State.FILE_IO:
            request.wait()
        elif state is _State.DEVICE_COPY:
            acc.synchronize(event)


class DeviceStager:
    """Reads and writes tensors of the current accelerator through two host buffers of ``chunk_bytes`` each
    (rounded up to the page size) with ``handle``. One transfer at a time (calls from several threads queue).
    Host tensors do not need it: use ``handle`` directly."""

    def __init__(self, handle: AsyncIOHandle, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive integer (bytes), got {chunk_bytes!r}")
        self.handle = handle
        self.chunk_bytes = -(-chunk_bytes // PAGE_SIZE) * PAGE_SIZE
        self._lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._slots_for: accelerator.Accelerator | None = None
        self._streams: dict[torch.device, object] = {}

    def read(self, tensor: torch.Tensor, file: FileRef, offset: int = 0) -> int:
        """Read ``tensor``'s bytes from ``offset`` of ``file`` into it; return the bytes read. On error (an
        ``OSError`` naming path and offset) the tensor's contents are unspecified."""
        acc = self._device_tensor(tensor, "read")
        dst = byte_view(tensor)
        chunks = self._chunks(dst.numel())
        with self._lock:
            slots, stream = self._setup(acc, tensor.device)

            def run() -> None:
                if chunks:
                    slots[0].start_io(self.handle.read_async(slots[0].buffer[:chunks[0][1]], file, offset))
                for k, (start, length) in enumerate(chunks):
                    slot = slots[k % 2]
                    slot.finish(acc)  # chunk k is in the host buffer
                    if k + 1 < len(chunks):
                        following, (next_start, next_length) = slots[(k + 1) % 2], chunks[k + 1]
                        following.finish(acc)  # its copy of chunk k-1 has completed: refill it
                        following.start_io(self.handle.read_async(following.buffer[:next_length], file,
                                                                  offset + next_start))
                    slot.start_copy(acc, dst[start:start + length], slot.buffer[:length], stream)

            self._run(acc, slots, run)
        return dst.numel()

    def write(self, tensor: torch.Tensor, file: FileRef, offset: int = 0, *, truncate: bool | None = None,
              fsync: bool = False) -> int:
        """Write ``tensor``'s bytes at ``offset`` of ``file``; return the bytes written. ``truncate`` (default:
        ``offset == 0``) cuts the file to end where this write ends; ``fsync`` makes it durable before returning.
        The tensor is only read, so it is intact whatever happens."""
        acc = self._device_tensor(tensor, "write")
        src = byte_view(tensor)
        truncate = offset == 0 if truncate is None else truncate
        chunks = self._chunks(src.numel())
        if not chunks:  # nothing to stage; the handle still truncates (or creates) the file as asked
            return self.handle.write(torch.empty(0, dtype=torch.uint8), file, offset, truncate=truncate, fsync=fsync)
        with self._lock:
            slots, stream = self._setup(acc, tensor.device)

            def run() -> None:
                slots[0].start_copy(acc, slots[0].buffer[:chunks[0][1]], src[:chunks[0][1]], stream)
                for k, (start, length) in enumerate(chunks):
                    slot, other = slots[k % 2], slots[(k + 1) % 2]
                    slot.finish(acc)  # chunk k is in the host buffer
                    last = k + 1 == len(chunks)
                    if not last:
                        next_start, next_length = chunks[k + 1]
                        other.finish(acc)  # its write of chunk k-1 has completed: refill it
                        other.start_copy(acc, other.buffer[:next_length], src[next_start:next_start + next_length],
                                         stream)
                    elif fsync:
                        other.finish(acc)  # every earlier chunk is written before the fsync that makes all durable
                    slot.start_io(self.handle.write_async(slot.buffer[:length], file, offset + start,
                                                          truncate=truncate and last, fsync=fsync and last))

            self._run(acc, slots, run)
        return src.numel()

    # -- internals ------------------------------------------------------------------------------------------
    @staticmethod
    def _device_tensor(tensor: torch.Tensor, what: str) -> accelerator.Accelerator:
        check_tensor(tensor, what)
        acc = accelerator.current()
        if not acc.is_device_tensor(tensor):
            raise ValueError(f"{what}: DeviceStager moves {acc.name} tensors; a tensor on {tensor.device} goes "
                             f"through AsyncIOHandle directly")
        return acc

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(start, min(self.chunk_bytes, nbytes - start)) for start in range(0, nbytes, self.chunk_bytes)]

    def _setup(self, acc: accelerator.Accelerator, device: torch.device) -> tuple[list[_Slot], object]:
        """The two slots (allocated on first use, page-locked for ``acc``) and the side stream for ``device``,
        which waits for the device's current stream."""
        if self._slots_for is not acc:
            self._slots = [_Slot(aligned_empty(self.chunk_bytes)) for _ in range(2)]
            self._slots_for, self._streams = acc, {}
        if device not in self._streams:
            self._streams[device] = acc.new_stream(device)
        stream = self._streams[device]
        acc.wait_for_current(stream, device)
        return self._slots, stream

    @staticmethod
    def _run(acc: accelerator.Accelerator, slots: list[_Slot], run) -> None:
        """Run the pipeline, then wait for everything still in flight: on success its errors are raised; after a
        failure they are dropped (the first error is the one raised) but the buffers are still waited for."""
        try:
            run()
        except BaseException:
            for slot in slots:
                try:
                    slot.finish(acc)
                except Exception:
                    pass
            raise
        error = None
        for slot in slots:
            try:
                slot.finish(acc)
            except Exception as e:
                error = error or e
        if error is not None:
            raise error
