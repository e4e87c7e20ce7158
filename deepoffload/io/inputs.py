"""What a transfer takes, checked before any IO: a tensor whose bytes can move, and a file.

The tensor is checked by ``check_tensor`` and seen as bytes through ``byte_view``; the file is a ``FileRef`` (a path
or an open descriptor). Shared by ``handle``, ``staging`` and ``compat``.
"""

from __future__ import annotations

import os
from typing import Union

import torch

from . import accelerator

FileRef = Union[str, bytes, os.PathLike, int]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _read_into_new(like: str, then: str) -> str:
    """The advice for a read into a tensor whose memory cannot take the bytes: a copy passed instead would get them."""
    return (
        f"read into a new tensor instead (buf = {like}; a copy such as tensor.contiguous() would get the bytes, "
        f"not this tensor), wait, then {then}"
    )


def check_tensor(tensor: object, what: str, *, filled: bool = False) -> torch.Tensor:
    """Check that ``tensor``'s bytes can be moved as they are: a contiguous, strided CPU or accelerator tensor.

    Args:
        tensor: What the caller passed as the tensor.
        what: The operation, which starts each message (``"read"``, ``"write"``, ...).
        filled: The operation writes into ``tensor`` (a read): the advice is then to read into a new tensor and
            take the values from it, as a copy passed instead would be filled and dropped.

    Returns:
        ``tensor`` itself.

    Raises:
        TypeError: When ``tensor`` is not a ``torch.Tensor``.
        ValueError: When it is quantized, sparse, a lazy conjugate/negative view, not contiguous, or on a device
            other than the CPU and the current accelerator (the message says what to pass instead).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    plain = "torch.empty(tensor.shape, dtype=tensor.dtype)"
    if tensor.is_quantized:
        advice = (
            _read_into_new("torch.empty_like(tensor.int_repr())", "dequantize buf with the scale and zero point saved")
            if filled
            else "pass tensor.int_repr() (and save q_scale()/q_zero_point()) or tensor.dequantize() instead"
        )
        raise ValueError(
            f"{what}: quantized tensors ({tensor.dtype}) keep their scale and zero point outside their bytes; {advice}"
        )
    if tensor.layout != torch.strided:
        advice = (
            _read_into_new(plain, "make the sparse tensor from buf") if filled else "pass tensor.to_dense() instead"
        )
        raise ValueError(f"{what}: sparse tensors ({tensor.layout}) have no single byte buffer; {advice}")
    if tensor.is_conj() or tensor.is_neg():  # a lazy view: its bytes in memory are not its values
        advice = (
            _read_into_new(plain, "tensor.copy_(buf)")
            if filled
            else "pass tensor.resolve_conj().resolve_neg() (a copy) instead"
        )
        raise ValueError(
            f"{what}: the tensor is a lazy conjugate/negative view whose memory holds other values; {advice}"
        )
    if not tensor.is_contiguous():
        advice = _read_into_new(plain, "tensor.copy_(buf)") if filled else "pass tensor.contiguous() (a copy) instead"
        raise ValueError(f"{what}: the tensor is not contiguous; {advice}")
    acc = accelerator.current()
    if tensor.device.type != "cpu" and not acc.is_device_tensor(tensor):
        supported = "CPU" + (f" or {acc.name}" if acc.device_type else "")  # "none" when there is no accelerator
        meta = "; a meta tensor has no bytes: make it with to_empty(device='cpu') first" if tensor.is_meta else ""
        raise ValueError(f"{what}: tensors on {tensor.device} are not supported ({supported}){meta}")
    return tensor
