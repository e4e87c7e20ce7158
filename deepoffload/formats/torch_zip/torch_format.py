"""``torch.save``'s zip format, produced by torch's own code: the bytes are exactly what ``torch.save`` writes.

That is, what ``torch.save`` writes to a file object.

Saving is split in two: ``record`` runs torch's serializer against a recorder that keeps each zip record (the pickle,
the format records, one record per storage) instead of writing it; ``write_records`` replays them into torch's zip
writer whose sink is a ``DirectWriter``. Between the two, ``snapshot`` can copy the storages into one staging arena
so the caller may change its tensors while the records are written (asynchronous save).
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from typing import Union

import torch
import torch.serialization

from ...io.buffers import aligned_empty
from .crc_ahead import CrcAhead
from .streams import DirectWriter
from .zip_crc import CrcFiller

Data = Union[bytes, str, torch.UntypedStorage]
Record = tuple[str, Data, int]  # (name inside the archive, bytes or storage, bytes)
RECORD_ALIGNMENT = 64  # bytes between storages in the staging arena


class _Recorder:
    """Stands in for torch's zip writer during ``torch.serialization._save`` and keeps the records in order."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def write_record(self, name: str, data: Data, nbytes: int) -> None:
        self.records.append((name, data, nbytes))

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        raise ValueError(
            "deepoffload.save cannot write checkpoints without data (torch.serialization.skip_data); "
            "use torch.save for that"
        )


def record(
    obj: object, pickle_module=pickle, pickle_protocol: int = torch.serialization.DEFAULT_PROTOCOL
) -> list[Record]:
    """Return the zip records ``torch.save(obj, f)`` would write, in its order; storages are referenced, not copied.

    Args:
        obj: What to save.
        pickle_module: The pickler module, as for ``torch.save``.
        pickle_protocol: The pickle protocol, as for ``torch.save``.

    Returns:
        ``(name inside the archive, bytes or storage, bytes)`` per record.
    """
    recorder = _Recorder()
    torch.serialization._save(obj, recorder, pickle_module, pickle_protocol, False)
    return recorder.records


def snapshot_bytes(records: list[Record]) -> tuple[int, bool]:
    """Size the arena ``snapshot`` needs for ``records``.

    Args:
        records: The records to snapshot.

    Returns:
        ``(bytes, pin)``: the arena's bytes, and whether it must be page-locked (a storage is on an accelerator, for
        the device-to-host copy).
    """
    storages = [data for _, data, _ in records if isinstance(data, torch.UntypedStorage)]
    total = sum(-(-s.nbytes() // RECORD_ALIGNMENT) * RECORD_ALIGNMENT for s in storages)
    return total, any(s.device.type != "cpu" for s in storages)


def snapshot(records: list[Record], arena: torch.Tensor | None = None) -> list[Record]:
    """Copy every storage of ``records`` into ``arena``, so the originals may change afterwards.

    The records returned use ``arena``'s memory: it must not be reused while they are.

    Args:
        records: The records (see ``record``).
        arena: A uint8 CPU tensor of at least ``snapshot_bytes(records)[0]`` bytes (default: a new page-aligned one).

    Returns:
        The same records, each storage replaced by its copy in ``arena``.

    Raises:
        ValueError: When ``arena`` is too small for the records.
    """
    if arena is None:
        total, pin = snapshot_bytes(records)
        arena = aligned_empty(max(total, 1), pin=pin)
    base = arena.untyped_storage()
    start = arena.storage_offset()
    copied: list[Record] = []
    offset = 0
    for name, data, nbytes in records:
        if isinstance(data, torch.UntypedStorage):
            if offset + nbytes > arena.numel():
                raise ValueError(f"snapshot: the arena of {arena.numel()} bytes is too small for the records")
            source = torch.empty(0, dtype=torch.uint8, device=data.device).set_(data, 0, (data.nbytes(),), (1,))
            arena[offset : offset + data.nbytes()].copy_(source)
            data = base[start + offset : start + offset + data.nbytes()]
            offset += -(-nbytes // RECORD_ALIGNMENT) * RECORD_ALIGNMENT
        copied.append((name, data, nbytes))
    return copied


def write_records(records: list[Record], sink: DirectWriter, checksum: bool) -> None:
    """Replay ``records`` through torch's zip writer into ``sink``.

    Stops early once the sink has failed; the caller closes the sink, which raises the error.

    Args:
        records: The records (see ``record``).
        sink: The stream to write to.
        checksum: Store the CRC-32 of every record (as ``torch.save`` does by default): torch's writer runs with its
            own CRC off and ``CrcFiller`` fills in each CRC, computed ahead from the record's memory (``CrcAhead``,
            large records) or while the bytes are staged. Without, the CRC fields hold 0 (as with
            ``torch.serialization.set_crc32_options(False)``).
    """
    ahead = CrcAhead(records) if checksum else None
    try:
        filler = CrcFiller(sink, ahead) if checksum else None
        # (torch's stub asks IO[bytes]; an io.RawIOBase file, as both sinks are, is not one to typeshed)
        writer = torch._C.PyTorchFileWriter(
            filler or sink,
            False,  # type: ignore[call-overload]
            torch.serialization._get_storage_alignment(),
        )
        try:
            for name, data, nbytes in records:
                if sink.error is not None:
                    break
                if filler is not None:
                    filler.expect(name, nbytes)
                writer.write_record(name, data, nbytes)
        except BaseException:
            try:  # finalize here: torch's destructor would do it and abort on an error
                writer.write_end_of_file()
            except Exception:
                pass  # torch's complaint about the half-written archive would hide the cause (Ctrl-C, a failed write)
            raise
        writer.write_end_of_file()
        if filler is not None and sink.error is None:
            filler.finish()
    finally:
        if ahead is not None:
            ahead.close()


_PICKLE_STARTS = b"\x80LIJ\x8a"  # the first byte of a legacy-format file: the pickled magic number, any protocol


def not_a_checkpoint(path: str) -> str | None:
    """Say why the file at ``path`` cannot be a ``torch.save`` checkpoint (a diagnosis for when loading it failed).

    Args:
        path: The file.

    Returns:
        The reason, judged from its size and first bytes, or None when it may be one (or cannot be read).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(10)
    except OSError:  # unreadable: no judgement from its bytes (the load's own error stands)
        return None
    if size == 0:
        return "the file is empty (0 bytes; an interrupted save or copy?)"
    if head.startswith(b"PK\x03\x04"):
        return (
            None
            if zipfile.is_zipfile(path)
            else (
                "it starts as a zip-format torch.save file but has no zip "
                "directory at its end: it is truncated or damaged"
            )
        )
    if zipfile.is_zipfile(path):  # a zip directory at the end, but no local header at the start
        return "it ends as a zip-format torch.save file but does not start as one: it is damaged"
    if len(head) == 10 and head[8:9] == b"{" and 8 + struct.unpack("<Q", head[:8])[0] <= size:
        if path.endswith(".safetensors"):
            return None  # read as one: its own error stands
        return "it is a safetensors file: read it with deepoffload.formats.load_file (or name it .safetensors)"
    if head[0] not in _PICKLE_STARTS:
        return f"it is neither a zip-format nor a legacy torch.save file (it starts with {head[:8]!r})"
    return None


def remove_quietly(path: str) -> None:
    """Remove ``path``, ignoring any ``OSError`` (a file that is gone, or cannot be removed)."""
    try:
        os.unlink(path)
    except OSError:  # gone already, or the caller's own error is the one to report
        pass
