"""``torch.save``'s zip format, produced by torch's own code so the bytes are exactly what ``torch.save`` writes to a
file object.

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
import zlib
from typing import Union

import torch
import torch.serialization

from ..io.buffers import aligned_empty
from ..swap.tensor_swapper import ChecksumError
from .streams import DirectWriter

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
        raise ValueError("deepoffload.save cannot write checkpoints without data (torch.serialization.skip_data); "
                         "use torch.save for that")


def record(obj: object, pickle_module=pickle, pickle_protocol: int = torch.serialization.DEFAULT_PROTOCOL
           ) -> list[Record]:
    """The zip records ``torch.save(obj, f)`` would write, in its order; storages are referenced, not copied."""
    recorder = _Recorder()
    torch.serialization._save(obj, recorder, pickle_module, pickle_protocol, False)
    return recorder.records


def snapshot(records: list[Record]) -> list[Record]:
    """The same records with every storage copied into one page-aligned arena (page-locked when a storage is on an
    accelerator, for the device-to-host copy), so the originals may change afterwards."""
    storages = [data for _, data, _ in records if isinstance(data, torch.UntypedStorage)]
    total = sum(-(-s.nbytes() // RECORD_ALIGNMENT) * RECORD_ALIGNMENT for s in storages)
    arena = aligned_empty(max(total, 1), pin=any(s.device.type != "cpu" for s in storages))
    base = arena.untyped_storage()
    start = arena.storage_offset()
    copied: list[Record] = []
    offset = 0
    for name, data, nbytes in records:
        if isinstance(data, torch.UntypedStorage):
            source = torch.empty(0, dtype=torch.uint8, device=data.device).set_(data, 0, (data.nbytes(),), (1,))
            arena[offset:offset + data.nbytes()].copy_(source)
            data = base[start + offset:start + offset + data.nbytes()]
            offset += -(-nbytes // RECORD_ALIGNMENT) * RECORD_ALIGNMENT
        copied.append((name, data, nbytes))
    return copied


def write_records(records: list[Record], sink: DirectWriter, checksum: bool) -> None:
    """Replay ``records`` through torch's zip writer into ``sink``. With ``checksum`` the CRC-32 of every record is
    computed and stored (as ``torch.save`` does by default); without, the CRC fields hold 0 (as with
    ``torch.serialization.set_crc32_options(False)``). Stops early once the sink has failed; the caller closes the
    sink, which raises the error."""
    writer = torch._C.PyTorchFileWriter(sink, checksum, torch.serialization._get_storage_alignment())
    try:
        for name, data, nbytes in records:
            if sink.error is not None:
                break
            writer.write_record(name, data, nbytes)
    finally:
        writer.write_end_of_file()  # always finalize here: torch's destructor would do it and abort on an error


class ZipChecksums:
    """Verifies the CRC-32 of the zip records of a ``torch.save`` file as they are read.

    ``on_read(offset, view)`` checks a read that covers exactly one record's data; ``finish(path)`` checks, by plain
    reads, every record that was not read that way. A mismatch raises ``ChecksumError`` naming the record and file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            archive = zipfile.ZipFile(path)
        except zipfile.BadZipFile as e:
            raise ValueError(f"{path}: not a zip-format torch.save file, so it has no checksums to verify; load it "
                             f"with checksum=False") from e
        self._records: dict[int, zipfile.ZipInfo] = {}
        with archive, open(path, "rb") as f:
            for info in archive.infolist():
                f.seek(info.header_offset)
                header = f.read(30)
                name_bytes, extra_bytes = struct.unpack("<HH", header[26:30])
                self._records[info.header_offset + 30 + name_bytes + extra_bytes] = info
        unrecorded = [i.filename for i in self._records.values() if i.CRC == 0 and i.file_size > 0]
        if unrecorded:
            raise ChecksumError(f"{path}: no checksums were recorded (saved with checksum=False or with torch's "
                                f"crc32 option off; first record without one: {unrecorded[0]}); load it with "
                                f"checksum=False")
        self._verified: set[int] = set()

    def on_read(self, offset: int, view: memoryview) -> None:
        info = self._records.get(offset)
        if info is not None and view.nbytes == info.file_size:
            self._check(info, zlib.crc32(view))
            self._verified.add(offset)

    def finish(self) -> None:
        with open(self.path, "rb") as f:
            for offset, info in self._records.items():
                if offset not in self._verified:
                    f.seek(offset)
                    self._check(info, zlib.crc32(f.read(info.file_size)))

    def _check(self, info: zipfile.ZipInfo, crc: int) -> None:
        if crc != info.CRC:
            raise ChecksumError(f"{self.path}: record {info.filename} ({info.file_size} bytes) has CRC-32 "
                                f"{crc:#010x}, the file recorded {info.CRC:#010x}: the checkpoint is corrupted")


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
