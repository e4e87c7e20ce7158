"""The accelerator-specific part of buffer handling, behind one small interface.

Today: CUDA (page-locked host memory registered with ``cudaHostRegister`` so device copies are asynchronous) or none.
Another accelerator (XPU, ...) adds a subclass and a line in ``current()``.
"""

from __future__ import annotations

import functools

import torch


class Accelerator:
    """No accelerator: host memory needs no registration and tensors are always on the CPU."""

    name = "none"

    def register_host(self, ptr: int, nbytes: int) -> bool:
        """Make [ptr, ptr+nbytes) usable for asynchronous device copies; True when it was registered."""
        return False

    def unregister_host(self, ptr: int) -> None:
        pass

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return False


class CudaAccelerator(Accelerator):
    name = "cuda"

    def register_host(self, ptr: int, nbytes: int) -> bool:
        if nbytes == 0:
            return False
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0

    def unregister_host(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"


@functools.lru_cache(maxsize=None)
def current() -> Accelerator:
    """The accelerator of this process (decided once)."""
    if torch.cuda.is_available():
        return CudaAccelerator()
    return Accelerator()
