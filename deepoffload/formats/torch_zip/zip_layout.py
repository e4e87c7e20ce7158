"""Checking a zip-format ``torch.save`` file's headers and directory before torch's reader trusts them.

torch's zip reader (miniz) follows the central directory's offsets and sizes and each local header's name and extra
lengths; a crafted size or offset made it raise a bare ``RuntimeError`` without the path, or hand out bytes shifted
into padding or the next record. ``check_layout`` refuses, with a ``CheckpointError`` naming the file and the record,
any layout ``torch.save`` cannot have written: a directory that is not where the end record says, a record whose
local header does not match its directory entry (signature, name, method, sizes), a compressed record
(``torch.save`` stores every record as is, and storages are sliced from the file's bytes), a malformed extra field,
a data descriptor that does not match, records that overlap or run past the directory, and duplicate names.
"""

from __future__ import annotations

import struct
import zipfile
from typing import Any

from ...errors import CheckpointError

_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # signature ... name length, extra length: 30 bytes
_LOCAL_SIGNATURE, _DESCRIPTOR_SIGNATURE = b"PK\x03\x04", b"PK\x07\x08"
_UNSUPPORTED = 0x01 | 0x20 | 0x40  # encrypted, patch data, strong encryption: flags torch.save never sets
_DIRECTORY = 0x10  # the MS-DOS directory attribute, which miniz takes to mean a folder
_PARSE_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    NotImplementedError,
    ValueError,
    struct.error,
    EOFError,
    KeyError,
    IndexError,
)


def check_layout(source: Any, path: str) -> None:
    """Refuse a zip file whose headers and directory ``torch.save`` cannot have written (see the module docstring).

    Reads only the end records, the central directory, the local headers and the data descriptors.

    Args:
        source: The file, a binary file object open for reading and seekable (read from any position; left at an
            unknown one).
        path: The file's name for messages.

    Raises:
        CheckpointError: Naming ``path``, the record and what is wrong.
    """
    problem: str | None
    try:
        end = zipfile._EndRecData(source)  # type: ignore[attr-defined]  # (private, stable since Python 2)
        if end is None:
            problem = TRUNCATED
        else:
            with zipfile.ZipFile(source) as archive:
                infos = archive.infolist()
                start_dir = archive.start_dir
            problem = None if end[zipfile._ECD_OFFSET] == start_dir else _MOVED  # type: ignore[attr-defined]
    except _PARSE_ERRORS as e:
        problem = f"its zip directory cannot be read ({type(e).__name__}: {e})"
    if problem == TRUNCATED:
        raise CheckpointError(f"cannot load {path}: {TRUNCATED}")
    problem = problem or _records_problem(source, infos, start_dir)
    if problem is not None:
        raise CheckpointError(f"cannot load {path}: {problem} (the file is damaged or was crafted)")


TRUNCATED = "it starts as a zip-format torch.save file but has no zip directory at its end: it is truncated or damaged"
_MOVED = "the zip directory is not where its end record says (a crafted directory size or offset)"


def _records_problem(source: Any, infos: list[zipfile.ZipInfo], start_dir: int) -> str | None:
    """What is wrong with the records listed in the directory starting at byte ``start_dir``; None if nothing."""
    names = [info.orig_filename for info in infos]
    if len(set(names)) != len(names):
        return "two zip records have the same name"
    ends = {}
    for info in infos:  # each record on its own first, so that the message names the record crafted
        problem, ends[info.orig_filename] = _record_problem(source, info)
        if problem is not None:
            return f"record {info.orig_filename}: {problem}"
    ordered = sorted(infos, key=lambda info: info.header_offset)
    for i, info in enumerate(ordered):
        limit = ordered[i + 1].header_offset if i + 1 < len(ordered) else start_dir
        if ends[info.orig_filename] > limit:
            return (
                f"record {info.orig_filename}: its bytes run to byte {ends[info.orig_filename]}, into the next "
                f"record or the zip directory (at byte {limit})"
            )
    return None


def _record_problem(source: Any, info: zipfile.ZipInfo) -> tuple[str | None, int]:
    """What is wrong with one record's headers (None if nothing), and where its bytes (descriptor included) end."""
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        return f"compressed (method {info.compress_type}); torch.save stores records as they are", 0
    if info.flag_bits & _UNSUPPORTED or info.external_attr & _DIRECTORY or info.orig_filename.endswith("/"):
        return "marked encrypted, patched or a directory, which torch.save never writes", 0
    source.seek(info.header_offset)
    header = source.read(_LOCAL.size)
    if len(header) != _LOCAL.size:
        return f"its local header at byte {info.header_offset} runs past the end of the file", 0
    signature, _, flags, method, _, _, crc, packed_size, size, name_length, extra_length = _LOCAL.unpack(header)
    if signature != _LOCAL_SIGNATURE:
        return f"no local header at byte {info.header_offset}, where the zip directory puts it", 0
    name = source.read(name_length)
    extra = source.read(extra_length)
    try:
        decoded = name.decode("utf-8" if flags & 0x800 else "cp437")
    except UnicodeDecodeError:
        decoded = None
    if decoded != info.orig_filename:
        return f"its local header names {name!r}", 0
    if method != zipfile.ZIP_STORED:
        return f"its local header says compression method {method}", 0
    if len(extra) != extra_length or not _extra_well_formed(extra):
        return f"its local header's extra field ({extra_length} bytes) is malformed", 0
    data_end = info.header_offset + _LOCAL.size + name_length + extra_length + info.file_size
    if flags & 0x08:  # sizes and CRC follow the data, in a data descriptor
        source.seek(data_end)
        descriptor = source.read(24)
        if descriptor.startswith(_DESCRIPTOR_SIGNATURE):
            descriptor, data_end = descriptor[4:], data_end + 4
        for layout, width in (("<III", 12), ("<IQQ", 20)):
            if len(descriptor) >= width and struct.unpack(layout, descriptor[:width]) == (
                info.CRC,
                info.file_size,
                info.file_size,
            ):
                data_end += width
                break
        else:
            return "its data descriptor does not match the zip directory's CRC and sizes", 0
    elif 0xFFFFFFFF not in (packed_size, size) and (crc, packed_size, size) != (
        info.CRC,
        info.file_size,
        info.file_size,
    ):
        return "its local header's CRC or sizes differ from the zip directory's", 0
    return None, data_end


def _extra_well_formed(extra: bytes) -> bool:
    """Whether ``extra`` is a sequence of (id, length, data) fields that fills it exactly."""
    position = 0
    while position + 4 <= len(extra):
        position += 4 + int.from_bytes(extra[position + 2 : position + 4], "little")
    return position == len(extra)
