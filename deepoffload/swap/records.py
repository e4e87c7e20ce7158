"""``SwapRecord``: where one swapped tensor lives and what it is, and the helpers that make and check records."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, cast

import torch

from .pool import round_up

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

TENSOR_ALIGNMENT = 64  # bytes between tensors of a group; a group's file and buffer region are page-aligned


def file_identity(path: str) -> tuple[int, int, int, int]:
    """What tells a file apart from a replacement or a rewrite.

    Args:
        path: The file.

    Returns:
        Its device, inode, size and modification time (ns).
    """
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class SwapRecord:
    """Where one swapped tensor lives and what it is.

    nbytes: the tensor's bytes (numel * element size). offset: its byte offset in ``file`` (a multiple of
    ``TENSOR_ALIGNMENT``, or of ``PACKED_ALIGNMENT`` in a pack file; any offset in a file served by ``map_group``).
    device: where it is restored. checksum: xxh3-64 of its bytes, or None. dtensor: (device mesh, placements,
    global shape, global stride) when the tensor was a DTensor (its local shard is what is stored), else None.
    codec: the byte codec its group's file was stored with (``deepoffload.swap.codecs``; ``none``: as it is).
    stored: the encoded length of its group's file (bytes, before page padding) when ``codec`` is not ``none``, else 0.
    slices: with ``checksum``, for a tensor of 3 or more dimensions, the xxh3-64 of each slice along its first dimension
    (what a slice read alone checks: an expert of a fused experts parameter), else ().
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: str
    offset: int
    device: torch.device
    checksum: int | None = None
    dtensor: tuple | None = None
    codec: str = "none"
    stored: int = 0
    slices: tuple[int, ...] = ()


def local_shard(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """A DTensor's local shard and its (mesh, placements, shape, stride); other tensors as they are.

    Args:
        tensor: The tensor to store.

    Returns:
        The tensor whose bytes are stored, and the DTensor's description (None for other tensors).
    """
    if hasattr(tensor, "to_local") and hasattr(tensor, "placements"):
        dtensor = cast("DTensor", tensor)  # (only DTensor has both)
        return dtensor.to_local(), (
            dtensor.device_mesh,
            tuple(dtensor.placements),
            tuple(dtensor.shape),
            dtensor.stride(),
        )
    return tensor, None


def check_group_name(group: object) -> None:
    """Refuse a group name that is not a file name.

    Args:
        group: The name.

    Raises:
        ValueError: Unless it is a non-empty string of letters, digits, ``-``, ``_`` and ``.``, not starting with
            ``.``.
    """
    if (
        not isinstance(group, str)
        or not group
        or not all(c.isalnum() or c in "-_." for c in group)
        or group.startswith(".")
    ):
        raise ValueError(f"group name {group!r}: use letters, digits, '-', '_' and '.' (it names a file)")


def checked_tensor(group: str, key: str, tensor: object) -> torch.Tensor:
    """``tensor`` when it has one byte buffer a swapper can store.

    Args:
        group: Its group's name (for the message).
        key: Its key (for the message).
        tensor: What the caller passed.

    Returns:
        ``tensor``.

    Raises:
        TypeError: When it is not a tensor.
        ValueError: When it is sparse or quantized.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"swap_out: {group}/{key} is a {type(tensor).__name__}, not a tensor")
    if tensor.layout != torch.strided or tensor.is_quantized:  # (is_sparse is False for CSR, CSC, BSR, BSC)
        raise ValueError(
            f"swap_out: {group}/{key} is sparse or quantized and has no single byte buffer; swap "
            f"tensor.to_dense() or tensor.dequantize() instead"
        )
    return tensor


def hash_bytes(region: torch.Tensor) -> int:
    """xxh3-64 of a contiguous CPU uint8 tensor's bytes, read in place (through ctypes, not numpy).

    Args:
        region: The bytes.

    Returns:
        Their hash (0 for none).

    Raises:
        ImportError: When the xxhash package is missing.
    """
    try:
        import xxhash
    except ImportError as e:
        raise ImportError("checksum=True needs the xxhash package: pip install xxhash") from e
    if not region.numel():
        return 0
    return xxhash.xxh3_64_intdigest((ctypes.c_char * region.numel()).from_address(region.data_ptr()))


def slice_hashes(region: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The xxh3-64 of each slice along the first dimension of a tensor of 3 or more dimensions (``SwapRecord.slices``).

    Args:
        region: The tensor's bytes (a contiguous CPU uint8 tensor).
        shape: The tensor's shape.

    Returns:
        One checksum per slice, or () for a tensor of fewer than 3 dimensions or no bytes.
    """
    if len(shape) < 3 or region.numel() == 0:
        return ()
    return tuple(hash_bytes(row) for row in region.view(shape[0], -1))


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (in elements).

    Args:
        shape: The shape.

    Returns:
        The strides.
    """
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def group_span(records: Iterable[SwapRecord]) -> int:
    """Bytes a group's file holds (the end of its last tensor, rounded up to the page size).

    Args:
        records: The group's records.

    Returns:
        The bytes.
    """
    return round_up(max((r.offset + r.nbytes for r in records), default=0))


def sliceable_checked(record: SwapRecord) -> bool:
    """Whether slices of ``record`` read alone are checked as the whole record is: it has no checksum, or one per slice.

    Args:
        record: A record.

    Returns:
        True when a slice read needs no check or can be checked (``SwapRecord.slices``).
    """
    return record.checksum is None or (len(record.shape) > 0 and len(record.slices) == record.shape[0])
