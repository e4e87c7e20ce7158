"""DeepSpeed's ``pin_memory`` op: ``pin_handle`` and the process-wide registry of the buffers it locks.

``aio_handle.new_cpu_locked_tensor`` registers its buffers here too, so a buffer locked by either handle is pinned for
both, as under DeepSpeed's pinned-tensor manager.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .buffers import aligned_empty, release_lock
from .inputs import check_tensor

# Buffers from new_cpu_locked_tensor, like DeepSpeed's process-wide pinned-tensor manager: start address -> bytes.
_managed_lock = threading.Lock()
_managed: dict[int, int] = {}


class pin_handle:  # noqa: N801  (DeepSpeed's name)
    """DeepSpeed's ``pin_memory`` op handle (``PinMemoryBuilder().load().pin_handle()``).

    It uses the registry ``aio_handle`` uses, so a buffer locked by either is pinned for both.
    """

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-aligned, page-locked 1-D tensor of ``num_elem`` elements of the example's dtype.

        Args:
            num_elem: The number of elements.
            example_tensor: A tensor of the dtype wanted.

        Returns:
            The tensor (contents uninitialised).
        """
        return new_locked(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, locked_tensor: torch.Tensor) -> bool:
        """As ``aio_handle.free_cpu_locked_tensor``.

        Args:
            locked_tensor: The tensor to free.

        Returns:
            True for a tensor from ``new_cpu_locked_tensor`` not freed yet, else False.
        """
        check_tensor(locked_tensor, "free_cpu_locked_tensor")
        return free_locked(locked_tensor.data_ptr())

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """As ``free_cpu_locked_tensor``, given the buffer's start address.

        Args:
            address: The buffer's ``data_ptr()``.

        Returns:
            True for a buffer from ``new_cpu_locked_tensor`` not freed yet, else False.

        Raises:
            TypeError: When ``address`` is not an int.
        """
        if isinstance(address, bool) or not isinstance(address, int):
            raise TypeError(f"free_cpu_locked_tensor_by_ptr: address must be an int, got {type(address).__name__}")
        return free_locked(address)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """As ``aio_handle.is_pinned``.

        Args:
            buffer: Any tensor.

        Returns:
            True when it is torch-pinned or inside a live locked buffer.
        """
        return pinned_or_locked(buffer)


def new_locked(num_elem: int, example: torch.Tensor) -> torch.Tensor:
    """A page-aligned, page-locked CPU tensor of ``num_elem`` elements of ``example``'s dtype, freed by ``free_locked``.

    Args:
        num_elem: The number of elements.
        example: A tensor whose dtype the buffer takes.

    Returns:
        The 1-D buffer (its memory is unlocked when it is freed or collected).

    Raises:
        TypeError: When ``example`` is not a tensor.
        ValueError: When ``num_elem`` is not a non-negative int.
    """
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"new_cpu_locked_tensor: the example must be a torch.Tensor, got {type(example).__name__}")
    if isinstance(num_elem, bool) or not isinstance(num_elem, int) or num_elem < 0:
        raise ValueError(f"num_elem must be a non-negative int, got {num_elem!r}")
    tensor = aligned_empty(num_elem, example.dtype)
    if tensor.numel():
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with _managed_lock:
            _managed[address] = nbytes
        weakref.finalize(tensor, _forget_managed, address)
    return tensor


def free_locked(address: int) -> bool:
    """Unlock the buffer from ``new_locked`` that starts at ``address`` (its memory goes when the tensor does).

    Args:
        address: The buffer's ``data_ptr()``.

    Returns:
        True when such a buffer was live, else False.
    """
    with _managed_lock:
        nbytes = _managed.pop(address, None)
    if nbytes is None:
        return False
    release_lock(address, nbytes)
    return True


def pinned_or_locked(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is torch-pinned or lies inside a live buffer from ``new_locked``.

    Args:
        buffer: Any tensor (anything else is not pinned).

    Returns:
        True when its memory is page-locked.
    """
    if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
        return False
    try:
        if buffer.is_pinned():
            return True
    except RuntimeError:  # torch without an accelerator backend cannot pin: only our own locked memory can be
        pass
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    with _managed_lock:
        return any(a <= start and end <= a + n for a, n in _managed.items())


def _forget_managed(address: int) -> None:
    with _managed_lock:
        _managed.pop(address, None)
