"""The host side of whichever accelerator PyTorch runs on (CUDA, ROCm, XPU, MPS, HPU, a PrivateUse1 backend, ...).

Everything goes through PyTorch's device-agnostic API: ``torch.accelerator`` names the accelerator, ``torch.Stream``
and ``torch.Event`` order the copies, and torch's pinned host allocator (``pin_memory=True``) page-locks host memory
for the current accelerator. The only backend-specific code is ``_HOST_REGISTER``: backends that can page-lock memory
we already own (so ``aligned_empty`` keeps its exact size and lifetime, where torch's caching host allocator rounds
sizes up and keeps freed memory).

Where an accelerator cannot page-lock host memory, buffers are ordinary memory (correct; device copies from them
are not asynchronous) and a warning says so once.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Callable, Iterator

import torch


def _cudart_register(ptr: int, nbytes: int) -> bool:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0


def _cudart_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


# device type -> (register [ptr, ptr+nbytes) -> True when page-locked, unregister ptr). ROCm builds report "cuda".
_HOST_REGISTER: dict[str, tuple[Callable[[int, int], bool], Callable[[int], None]]] = {
    "cuda": (_cudart_register, _cudart_unregister),
}

_warned_unpinned = False
_warn_lock = threading.Lock()


def warn_unpinned(device_type: str, reason: str) -> None:
    """Say once per process that host buffers for ``device_type`` are ordinary (pageable) memory.

    Args:
        device_type: The accelerator's device type (``"cuda"``, ...).
        reason: Why host memory could not be page-locked.
    """
    global _warned_unpinned
    with _warn_lock:
        if _warned_unpinned:
            return
        _warned_unpinned = True
    warnings.warn(
        f"deepoffload: cannot page-lock host memory for the {device_type} accelerator ({reason}); using "
        f"ordinary memory, which is correct but makes device copies synchronous",
        RuntimeWarning,
        stacklevel=3,
    )


class Accelerator:
    """Host-side operations for one accelerator type.

    Streams and events are ``torch.Stream``/``torch.Event``. A test double overrides the methods below the
    "device operations" line to run on host memory.

    Args:
        device_type: The accelerator's device type (``"cuda"``, ``"xpu"``, ...); None means no accelerator (CPU only).
    """

    def __init__(self, device_type: str | None = None):
        self.device_type = device_type

    @property
    def name(self) -> str:
        """The device type, or ``"none"`` without an accelerator (for messages)."""
        return self.device_type or "none"

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in this accelerator's memory (and must be staged through host memory).

        Args:
            tensor: Any tensor.

        Returns:
            True for a tensor on this accelerator's device type.
        """
        return self.device_type is not None and tensor.device.type == self.device_type

    # -- host memory ------------------------------------------------------------------------------------------
    def can_register_host(self) -> bool:
        """True when memory allocated elsewhere can be page-locked for this accelerator (``register_host``)."""
        return self.device_type in _HOST_REGISTER

    def register_host(self, ptr: int, nbytes: int) -> bool:
        """Page-lock [ptr, ptr+nbytes) for asynchronous device copies.

        Args:
            ptr: The start address.
            nbytes: The length in bytes.

        Returns:
            True when the memory was page-locked. False (warned once) when this accelerator refuses; False silently
            when there is no accelerator, it cannot register host memory, or there is nothing to register.
        """
        if self.device_type is None or nbytes == 0:
            return False
        entry = _HOST_REGISTER.get(self.device_type)
        if entry is None:
            return False
        try:
            ok = entry[0](ptr, nbytes)
        except (RuntimeError, OSError) as e:
            ok, reason = False, str(e)
        else:
            reason = "host registration returned an error"
        if not ok:
            warn_unpinned(self.device_type, reason)
        return ok

    def unregister_host(self, ptr: int) -> None:
        """Undo ``register_host`` for the memory starting at ``ptr`` (nothing where this accelerator cannot register).

        Args:
            ptr: The start address given to ``register_host``.
        """
        entry = _HOST_REGISTER.get(self.device_type or "")
        if entry is not None:
            entry[1](ptr)

    def pinned_empty(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of page-locked host memory from torch's pinned allocator for this accelerator.

        Freed memory returns to torch's host cache (``torch.accelerator.empty_host_cache()`` releases it).

        Args:
            nbytes: The size in bytes.

        Returns:
            A 1-D uint8 tensor, or None (warned once) where the allocator fails, and None without an accelerator.
        """
        if self.device_type is None:
            return None
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            warn_unpinned(self.device_type, str(e).splitlines()[0])
            return None

    # -- device operations --------------------------------------------------------------------------------------
    def new_stream(self, device: torch.device) -> torch.Stream | None:
        """A side stream on ``device`` for staging copies.

        Args:
            device: The device the copies run on.

        Returns:
            The stream, or None where the backend has no streams or no events (copies are then synchronous).
        """
        try:
            stream = torch.Stream(device=device)
            stream.record_event().synchronize()  # fails here, not mid-transfer, where events are missing
            return stream
        except (RuntimeError, NotImplementedError):  # a backend without streams or events: synchronous copies
            return None

    def wait_for_current(self, stream: torch.Stream | None, device: torch.device) -> None:
        """Make ``stream`` wait for the work queued so far on ``device``'s current stream.

        That work produced, or last used the memory of, the tensor being staged.

        Args:
            stream: The side stream (None: nothing to do, copies are synchronous).
            device: The device whose current stream is waited for.
        """
        if stream is not None:
            stream.wait_stream(torch.accelerator.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.Stream | None) -> torch.Event | None:
        """Queue ``dst.copy_(src)`` (one side on the host, one on the device) on ``stream``.

        Args:
            dst: The tensor copied into.
            src: The tensor copied from (same size).
            stream: The side stream, or None to copy synchronously.

        Returns:
            An event that completes with the copy, or None when the copy has already completed.
        """
        if stream is None:
            dst.copy_(src)
            return None
        with stream:
            dst.copy_(src, non_blocking=True)
        return stream.record_event()

    def synchronize(self, event: torch.Event | None) -> None:
        """Block until ``event`` (from ``copy``; None: nothing to wait for) has completed."""
        if event is not None:
            event.synchronize()


_override: Accelerator | None = None


@functools.lru_cache(maxsize=None)
def _detected() -> Accelerator:
    device = torch.accelerator.current_accelerator(check_available=True)
    return Accelerator(device.type if device is not None else None)


def current() -> Accelerator:
    """The accelerator of this process (detected once), or the one ``use()`` installed."""
    return _override if _override is not None else _detected()


@contextlib.contextmanager
def use(accelerator: Accelerator) -> Iterator[Accelerator]:
    """Make ``accelerator`` the current one inside the block (for tests: a double that runs on host memory)."""
    global _override
    previous, _override = _override, accelerator
    try:
        yield accelerator
    finally:
        _override = previous
