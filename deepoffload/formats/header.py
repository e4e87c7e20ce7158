"""The safetensors header: its dtypes, a strict parser and an encoder.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON (an object mapping each
tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}``, plus an optional ``"__metadata__"`` object of
strings), then the tensors' raw little-endian bytes, back to back. Offsets count from the end of the header. The
parser accepts exactly what the reference reader (``safetensors``) accepts: the tensors must cover the data region
without gaps or overlaps and end where the file ends. An ``F4`` shape counts 4-bit values, two per element of torch's
``float4_e2m1fn_x2`` along the last dimension; one whose last size is odd is refused here (safetensors refuses it when
the tensor is read).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from typing import Mapping

import torch

from ..errors import CheckpointError, CheckpointNotFoundError, UnsupportedError

MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit
INT64_MAX = 2**63 - 1  # torch's sizes and strides are signed 64-bit
METADATA_KEY = "__metadata__"

# fp8, fp4 and unsigned ints are recent: the dtypes this torch lacks are left out (as safetensors leaves them out)
DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in (
        ("F64", torch.float64),
        ("F32", torch.float32),
        ("F16", torch.float16),
        ("BF16", torch.bfloat16),
        ("I64", torch.int64),
        ("I32", torch.int32),
        ("I16", torch.int16),
        ("I8", torch.int8),
        ("U8", torch.uint8),
        ("BOOL", torch.bool),
        ("C64", torch.complex64),
        ("U64", getattr(torch, "uint64", None)),
        ("U32", getattr(torch, "uint32", None)),
        ("U16", getattr(torch, "uint16", None)),
        ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
        ("F8_E5M2", getattr(torch, "float8_e5m2", None)),
        ("F8_E4M3FNUZ", getattr(torch, "float8_e4m3fnuz", None)),
        ("F8_E5M2FNUZ", getattr(torch, "float8_e5m2fnuz", None)),
        ("F8_E8M0", getattr(torch, "float8_e8m0fnu", None)),
        ("F4", getattr(torch, "float4_e2m1fn_x2", None)),
    )
    if dtype is not None
}
"""safetensors dtype names (``"F32"``, ``"BF16"``, ...) -> torch dtypes, for the dtypes this torch has."""
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
# a header counts F4 values (4 bits each); torch's float4_e2m1fn_x2 packs two in each element of the last dimension
PACKED: dict[torch.dtype, int] = {DTYPES["F4"]: 2} if "F4" in DTYPES else {}


def header_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> list[int]:
    """The shape a header records for a torch tensor of ``dtype`` and ``shape`` (F4: the last size doubled).

    Args:
        dtype: The tensor's dtype (one of ``DTYPE_NAMES``).
        shape: Its torch shape.

    Returns:
        The header's shape.

    Raises:
        ValueError: For a 0-dim packed tensor, which safetensors cannot record either.
    """
    packed = PACKED.get(dtype, 1)
    if packed == 1:
        return list(shape)
    if not shape:
        raise ValueError(
            f"a 0-dim {dtype} tensor packs {packed} values that a safetensors shape cannot record (safetensors "
            f"refuses it too): save tensor.reshape(1) and reshape it back after loading"
        )
    return [*shape[:-1], shape[-1] * packed]


def check_little_endian() -> None:
    """safetensors (and the byte views used here) are little-endian; refuse to run where they would be wrong."""
    if sys.byteorder != "little":
        raise UnsupportedError(
            "deepoffload.formats reads and writes checkpoint bytes as-is and needs a little-endian "
            f"host; this one is {sys.byteorder}-endian: use safetensors' own reader here"
        )


def element_size(dtype: torch.dtype) -> int:
    """Return the bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: ``path``, absolute byte offsets ``[start, end)`` in that file, its dtype and shape."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """The tensor's bytes in the file."""
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A file of tensors at known byte ranges.

    A parsed safetensors file (its tensors in file order, its metadata and where its data region starts), or a file
    of raw tensors ``raw_file`` described (no metadata, data from byte 0).
    """

    path: str
    entries: dict[str, TensorEntry]
    metadata: dict[str, str] | None
    data_start: int
    file_size: int
    identity: tuple[int, ...] = ()  # the file's (device, inode, bytes, mtime in ns) when the header was read


def file_identity(stat: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is replaced or rewritten: its device, inode, size in bytes and mtime in ns."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _no_duplicates(pairs: list) -> dict:
    result = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(raw: bytes, file_size: int, path: str) -> Header:
    """Validate and parse a safetensors file from its first bytes and its total size.

    The parser accepts exactly what the reference reader accepts (see the module docstring).

    Args:
        raw: The file's first bytes: at least the length field and the whole header.
        file_size: The file's total size in bytes.
        path: The file's path (recorded in the entries and named in errors).

    Returns:
        The header: the tensors' entries in file order (absolute offsets), the metadata and where the data starts.

    Raises:
        CheckpointError: Naming ``path`` and what is wrong, when the file is not a valid safetensors file.
        ValueError: When ``raw`` is shorter than the length field says the header is (a caller's error).
    """  # noqa: DOC501, DOC502 -- ruff takes bad(...) for an exception class; it returns the CheckpointError

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a valid safetensors file: {reason}")

    if file_size < 8 or len(raw) < 8:
        raise bad(f"{file_size} bytes is shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", raw[:8])
    if length > MAX_HEADER_BYTES:
        raise bad(f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    if 8 + length > file_size:
        raise bad(f"header length {length} runs past the end of the {file_size}-byte file")
    if len(raw) < 8 + length:
        raise ValueError(f"parse_header needs the first {8 + length} bytes, got {len(raw)}")
    try:
        text = raw[8 : 8 + length].decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("the header does not start with '{'")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"the header is not a JSON object ({e})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad(f"{METADATA_KEY} must be an object of strings")
    data_start = 8 + length
    data_bytes = file_size - data_start
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r}: expected exactly the keys dtype, shape, data_offsets, got {info!r:.200}")
        dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype_name not in DTYPES:
            raise bad(
                f"tensor {name!r}: dtype {dtype_name!r} is unknown or not supported by this torch "
                f"(known: {', '.join(DTYPES)})"
            )
        if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)):
            raise bad(f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r:.200}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise bad(
                f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r:.200}"
            )
        if math.prod(max(size, 1) for size in shape) > INT64_MAX:  # a zero size would hide it from the product
            raise bad(f"tensor {name!r}: shape {shape!r:.200} overflows 64-bit sizes and strides")
        dtype = DTYPES[dtype_name]
        packed = PACKED.get(dtype, 1)
        if math.prod(shape) % packed:
            raise bad(
                f"tensor {name!r}: {dtype_name} of shape {shape} does not end at a byte boundary ({packed} values "
                f"per byte)"
            )
        if packed != 1 and (not shape or shape[-1] % packed):
            raise bad(
                f"tensor {name!r}: {dtype_name} of shape {shape}: torch's {dtype} packs {packed} values along the last "
                f"dimension, so its size must be a multiple of {packed} (safetensors cannot load it into torch either)"
            )
        nbytes = math.prod(shape) // packed * element_size(dtype)
        if packed != 1:
            shape = [*shape[:-1], shape[-1] // packed]
        if offsets[1] - offsets[0] != nbytes:
            raise bad(
                f"tensor {name!r}: {dtype_name} of shape {shape} takes {nbytes} bytes but data_offsets "
                f"{offsets} span {offsets[1] - offsets[0]}"
            )
        if offsets[1] > data_bytes:
            raise bad(f"tensor {name!r}: data_offsets {offsets} run past the {data_bytes}-byte data region")
        spans.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    spans.sort(key=lambda s: (s[0], s[1]))
    position, previous = 0, None
    for begin, end, name, _, _ in spans:
        if begin < position:
            raise bad(f"tensors {previous!r} and {name!r} overlap (at data offset {begin})")
        if begin > position:
            raise bad(f"{begin - position} bytes before tensor {name!r} (data offset {position}) belong to no tensor")
        position, previous = end, name
    if position != data_bytes:
        raise bad(
            f"the tensors end at data offset {position} but the data region is {data_bytes} bytes "
            f"(truncated or trailing bytes)"
        )
    entries = {
        name: TensorEntry(name, path, dtype, shape, data_start + begin, data_start + end)
        for begin, end, name, dtype, shape in spans
    }
    return Header(path, entries, metadata, data_start, file_size)


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of the safetensors file at ``path`` (two small buffered reads).

    Args:
        path: The safetensors file.

    Returns:
        Its parsed header (see ``parse_header``), with the file's identity when it was read.

    Raises:
        CheckpointNotFoundError: (a CheckpointError and a FileNotFoundError) When ``path`` does not exist.
        CheckpointError: When ``path`` is a folder (and, from ``parse_header``, when the file is
            not valid safetensors).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            file_size = stat.st_size
            raw = f.read(8)
            if len(raw) == 8:
                (length,) = struct.unpack("<Q", raw)
                if length <= MAX_HEADER_BYTES and 8 + length <= file_size:
                    raw += f.read(length)
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a folder, not a safetensors file") from None
    except FileNotFoundError:
        raise CheckpointNotFoundError(errno.ENOENT, "no such safetensors file", path) from None
    return dataclasses.replace(parse_header(raw, file_size, path), identity=file_identity(stat))


def encode_header(
    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...], int, int]],
    metadata: Mapping[str, str] | None,
    reserve: int = 0,
) -> bytes:
    """Encode the 8-byte length and JSON header for ``tensors``.

    Args:
        tensors: Name -> (dtype, shape, data begin, data end).
        metadata: Strings for the ``__metadata__`` object (none when empty or None).
        reserve: The total bytes to pad to with spaces (which the format allows); 0: a multiple of 8.

    Returns:
        The length field and the padded header.

    Raises:
        ValueError: When the header does not fit in ``reserve``.
    """
    header: dict = {}
    if metadata:
        header[METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
    for name, (dtype, shape, begin, end) in tensors.items():
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": header_shape(dtype, shape), "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    total = reserve if reserve else 8 + (len(text) + 7) // 8 * 8
    if 8 + len(text) > total:
        raise ValueError(f"header of {8 + len(text)} bytes does not fit in {total}")
    body = text + b" " * (total - 8 - len(text))
    return struct.pack("<Q", len(body)) + body


def raw_file(path: str | os.PathLike, tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...], int]]) -> Header:
    """Describe a file holding tensors as raw little-endian bytes at known offsets, for ``OpenedCheckpoint.files``.

    Args:
        path: The file.
        tensors: Name -> (dtype, shape, offset of its first byte in the file).

    Returns:
        A ``Header`` with one ``TensorEntry`` per tensor, in file order, and the file's identity now (a file changed
        after this is refused when read).

    Raises:
        CheckpointError: When a tensor runs past the end of the file, or the file cannot be opened.

    Examples:
        >>> import torch
        >>> from deepoffload.formats import raw_file
        >>> _ = open("w.raw", "wb").write(torch.arange(6.0).numpy().tobytes())
        >>> header = raw_file("w.raw", {"w": (torch.float32, (2, 3), 0)})
        >>> header.entries["w"].start, header.entries["w"].end, header.file_size
        (0, 24, 24)
    """
    check_little_endian()
    path = os.fspath(path)
    try:
        stat = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open it as a file of raw tensors: {e}") from None
    entries = []
    for name, (dtype, shape, start) in tensors.items():
        end = start + math.prod(shape) * element_size(dtype)
        if start < 0 or end > stat.st_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype}, shape {list(shape)}) at bytes [{start}, {end}) runs past the end "
                f"of the {stat.st_size}-byte file"
            )
        entries.append(TensorEntry(name, path, dtype, tuple(shape), start, end))
    entries.sort(key=lambda e: (e.start, e.end))
    return Header(path, {e.name: e for e in entries}, None, 0, stat.st_size, file_identity(stat))
