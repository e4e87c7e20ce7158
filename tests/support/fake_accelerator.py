"""A test double for ``deepoffload.io.accelerator.Accelerator`` that runs on host memory, and a recording handle.

``FakeAccelerator``: its "device tensors" are CPU tensors it created (``to_device``); copies queued on a stream run
only when an event at or after them is synchronized, so a host buffer refilled before its copy completed corrupts
the result. Every call is logged, and ``check_log`` replays the log (with ``RecordingHandle``'s file IO) to prove that
no host range was in use by two transfers at once and that nothing was left in flight.
"""

from __future__ import annotations

import torch

from deepoffload.io import accelerator


class FakeStream:
    def __init__(self, name: str):
        self.name = name
        self.queue: list = []  # (sequence number, copy) not yet run
        self.issued = 0

    def run_until(self, sequence: int) -> None:
        while self.queue and self.queue[0][0] <= sequence:
            self.queue.pop(0)[1]()


class FakeEvent:
    def __init__(self, stream: FakeStream, sequence: int, host: tuple[int, int]):
        self.stream, self.sequence, self.host = stream, sequence, host


class FakeAccelerator(accelerator.Accelerator):
    """``pinning``: "register" (host memory we own is registered), "allocator" (pinned memory comes from the
    accelerator's own allocator), or "none" (the accelerator refuses both: warned once, then ordinary memory).
    ``fail_sync_at``: the n-th synchronize (from 1) raises like a device error."""

    def __init__(self, pinning: str = "register", streams: bool = True, fail_sync_at: int | None = None):
        super().__init__("fake")
        self.pinning, self.streams, self.fail_sync_at = pinning, streams, fail_sync_at
        self.log: list[tuple] = []
        self.device_storages: set[int] = set()
        self.pinned: dict[int, int] = {}  # start -> bytes
        self.syncs = 0

    # -- device memory --------------------------------------------------------------------------------------
    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        self.device_storages.add(copy.untyped_storage().data_ptr())
        return copy

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.to_device(torch.full_like(tensor, 0))

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.device_storages

    # -- host memory ----------------------------------------------------------------------------------------
    def can_register_host(self) -> bool:
        return self.pinning == "register"

    def register_host(self, ptr: int, nbytes: int) -> bool:
        self.log.append(("register", ptr, nbytes))
        self.pinned[ptr] = nbytes
        return True

    def unregister_host(self, ptr: int) -> None:
        self.log.append(("unregister", ptr))
        self.pinned.pop(ptr, None)

    def pinned_empty(self, nbytes: int) -> torch.Tensor | None:
        if self.pinning == "allocator":
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            self.pinned[tensor.data_ptr()] = nbytes
            self.log.append(("pinned_empty", tensor.data_ptr(), nbytes))
            return tensor
        accelerator.warn_unpinned(self.device_type, "the fake accelerator has no pinned allocator")
        return None

    def is_pinned(self, ptr: int, nbytes: int) -> bool:
        return any(start <= ptr and ptr + nbytes <= start + length for start, length in self.pinned.items())

    # -- device operations ----------------------------------------------------------------------------------
    def new_stream(self, device: torch.device) -> FakeStream | None:
        self.log.append(("new_stream", str(device)))
        return FakeStream(f"side{len(self.log)}") if self.streams else None

    def wait_for_current(self, stream, device: torch.device) -> None:
        self.log.append(("wait_for_current", stream.name if stream is not None else None))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream | None) -> FakeEvent | None:
        if self.is_device_tensor(dst) == self.is_device_tensor(src):
            raise AssertionError("a staging copy must have exactly one side on the device")
        host = src if self.is_device_tensor(dst) else dst
        nbytes = host.numel() * host.element_size()
        direction = "h2d" if host is src else "d2h"
        self.log.append(("copy", direction, host.data_ptr(), nbytes, self.is_pinned(host.data_ptr(), nbytes)))
        if stream is None:
            dst.copy_(src)
            self.log.append(("copied", host.data_ptr(), nbytes))
            return None
        stream.issued += 1
        stream.queue.append((stream.issued, lambda: dst.copy_(src)))
        return FakeEvent(stream, stream.issued, (host.data_ptr(), nbytes))

    def synchronize(self, event: FakeEvent | None) -> None:
        if event is None:
            return
        self.syncs += 1
        if self.syncs == self.fail_sync_at:
            raise RuntimeError("fake device error during synchronize")
        event.stream.run_until(event.sequence)
        self.log.append(("copied", *event.host))


class RecordingRequest:
    def __init__(self, request, log: list, host: tuple[int, int]):
        self._request, self._log, self._host = request, log, host

    def wait(self, timeout=None) -> int:
        try:
            return self._request.wait(timeout)
        finally:
            self._log.append(("io_done", *self._host))


class RecordingHandle:
    """Wraps an ``AsyncIOHandle`` so its asynchronous transfers appear in ``log`` (normally the fake's)."""

    def __init__(self, handle, log: list):
        self._handle, self._log = handle, log
        self.calls: list[tuple] = []  # (kind, file offset, bytes, truncate, fsync)

    def _host(self, tensor: torch.Tensor) -> tuple[int, int]:
        return tensor.data_ptr(), tensor.numel() * tensor.element_size()

    def read_async(self, tensor, file, offset=0):
        self._log.append(("io", "read", *self._host(tensor)))
        self.calls.append(("read", offset, tensor.numel(), None, None))
        return RecordingRequest(self._handle.read_async(tensor, file, offset), self._log, self._host(tensor))

    def write_async(self, tensor, file, offset=0, *, truncate=None, fsync=False):
        self._log.append(("io", "write", *self._host(tensor)))
        self.calls.append(("write", offset, tensor.numel(), truncate, fsync))
        return RecordingRequest(
            self._handle.write_async(tensor, file, offset, truncate=truncate, fsync=fsync),
            self._log,
            self._host(tensor),
        )

    def write(self, *args, **kwargs):
        return self._handle.write(*args, **kwargs)


def check_log(log: list) -> None:
    """Fail when a host range was used by a copy and a file transfer (or two of either) at once, when a copy
    read or wrote unpinned host memory, or when anything was still in flight at the end."""
    busy: dict[tuple[int, int], str] = {}
    for entry in log:
        if entry[0] in ("copy", "io"):
            what = f"{entry[0]} {entry[1]}"
            ptr, nbytes = entry[2], entry[3]
            if entry[0] == "copy" and not entry[4]:
                raise AssertionError(f"{what} of {nbytes} bytes used unpinned host memory")
            for (start, length), other in busy.items():
                if ptr < start + length and start < ptr + nbytes:
                    raise AssertionError(f"{what} at {ptr:#x} started while {other} used that host memory")
            busy[(ptr, nbytes)] = what
        elif entry[0] in ("copied", "io_done"):
            busy.pop((entry[1], entry[2]), None)
    if busy:
        raise AssertionError(f"still in flight at the end: {sorted(busy.values())}")
