"""The CRC-32 fields of ``torch.save``'s zip format: filled in while saving, verified while loading.

``CrcFiller`` is the sink for torch's zip writer run with its CRC off: it passes every byte on to a ``DirectWriter``
and fills in the CRC-32 fields ``torch.save`` would have written. ``ZipChecksums`` checks those fields against the
records' bytes as a file is read.
"""

from __future__ import annotations

import ctypes
import errno
import io
import struct
import zipfile

import torch

from ...errors import ChecksumError, DeepOffloadError
from ...io.crc import crc32
from .crc_ahead import CrcAhead
from .streams import DirectWriter

SERIALIZATION_ID = ".data/serialization_id"  # the record torch's writer adds last


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``."""
    return (seed ^ (value + 0x9E3779B9 + (seed << 6) + (seed >> 2))) & 0xFFFFFFFFFFFFFFFF


class ZipLayoutError(DeepOffloadError, RuntimeError):
    """torch's zip writer produced a layout ``CrcFiller`` does not know, so it cannot fill in the CRCs exactly."""


_LOCAL, _CENTRAL, _DESCRIPTOR = b"PK\x03\x04", b"PK\x01\x02", b"PK\x07\x08"
_END = (b"PK\x06\x06", b"PK\x05\x06")  # zip64 end record, end record: after the central directory


class CrcFiller(io.RawIOBase):
    """The sink for torch's zip writer (its CRC off): passes every byte on and fills in the CRC-32 fields.

    Every byte goes on to a ``DirectWriter``, with the CRC-32 fields ``torch.save`` would have written.

    torch writes each record as a local header (30 bytes, then the name and extra field whose lengths it gives;
    sizes and CRC are left 0 and a data descriptor follows), the data in one write, and a data descriptor (CRC and
    sizes), or for an empty record only the local header; then the central directory (one entry per record, each
    with the CRC) and the end records. The CRC is computed ahead from the record's memory (``CrcAhead``) or on the
    data while it is staged (``write_digest``), written into the descriptor, whose sizes must equal the bytes
    counted, and into the record's central directory entry, which is held until complete. The last record, the
    serialization id, combines the CRCs (see ``_serialization_id``). Anything else raises ``ZipLayoutError``: a file
    with wrong CRCs is never produced.

    Args:
        sink: The stream the bytes go to.
        ahead: CRCs of large records computed from their memory, on another thread (default: every CRC is computed
            while the data is staged).
    """

    def __init__(self, sink: DirectWriter, ahead: CrcAhead | None = None) -> None:
        super().__init__()
        self.sink = sink
        self._ahead = ahead  # CRCs of large records computed from their memory, on another thread
        self.crcs: dict[str, int] = {}  # record name -> CRC-32
        self._patched: set[str] = set()
        self._state = "signature"  # signature | local | data | central | end
        self._held = bytearray()  # header bytes collected so far
        self._need = 4  # bytes the header part being collected needs
        self._name = ""
        self._count = 0  # data bytes of the current record so far
        self._crc = 0
        self._combined = self._combined_without = 0  # torch's combined CRCs: real ones, and the zeros it saw
        self._expected: tuple[str, int] = ("", 0)  # the record write_record is writing, and its bytes

    def writable(self) -> bool:
        """Return True: the stream is written."""
        return True

    def tell(self) -> int:
        """Return the sink's position: the bytes passed on so far."""
        return self.sink.tell()

    def expect(self, name: str, nbytes: int) -> None:
        """Announce the next record: no write before ``nbytes`` of its data is taken for its descriptor.

        Args:
            name: The record's name, without the archive prefix.
            nbytes: Its data's bytes.
        """
        self._expected = (name, nbytes)

    def write(self, data) -> int:
        """Pass ``data`` on to the sink, filling in CRC fields and holding central directory entries until complete.

        Args:
            data: A bytes-like object: one write of torch's zip writer.

        Returns:
            The bytes taken: all of ``data``.

        Raises:
            ZipLayoutError: When a write holds a header and data at once (a layout this does not know).
        """
        view = memoryview(data).cast("B")
        if self._state == "end":
            self.sink.write(view)
        elif self._state == "data":
            if not self._data(view) and view.nbytes >= 8 and bytes(view[:4]) == _DESCRIPTOR:
                value = struct.unpack_from("<I", view, 4)[0]  # torch combines whatever looks like a descriptor
                self._combine(value, value)
        else:
            done = 0
            while done < view.nbytes:
                if self._state == "end":
                    self.sink.write(view[done:])
                    break
                if self._state == "data":
                    raise ZipLayoutError(self._describe("a header and data in one write"))
                take = min(self._need - len(self._held), view.nbytes - done)
                piece = view[done : done + take]
                self._held += piece
                done += take
                if self._state == "local":
                    self.sink.write(piece)
                if len(self._held) == self._need:
                    self._header_part_complete()
        return view.nbytes

    def finish(self) -> None:
        """Check that the whole stream was understood and every record's CRC reached the central directory.

        Raises:
            ZipLayoutError: When it was not.
        """
        if self._state != "end" or self._patched != set(self.crcs):
            raise ZipLayoutError(
                self._describe(
                    f"a stream ending in state {self._state!r}, with central directory "
                    f"entries for {len(self._patched)} of {len(self.crcs)} records"
                )
            )

    # -- internals ---------------------------------------------------------------------------------------------
    def _data(self, view: memoryview) -> bool:
        """One write in a record's data: its bytes, or the descriptor that ends them (then return True)."""
        name, nbytes = self._expected
        known = self._name.partition("/")[2] == name
        ahead = self._ahead.get(name) if known and self._ahead is not None else None
        if (not known or self._count == nbytes) and view.nbytes in (16, 24) and bytes(view[:4]) == _DESCRIPTOR:
            descriptor = bytearray(view)
            crc, *sizes = struct.unpack_from("<IQQ" if view.nbytes == 24 else "<III", descriptor, 4)
            if crc == 0 and sizes == [self._count, self._count]:
                if ahead is not None:  # the data went through unhashed: its CRC was computed from its memory
                    self._crc = ahead.result()
                struct.pack_into("<I", descriptor, 4, self._crc)
                self.sink.write(descriptor)
                self.crcs[self._name] = self._crc
                self._combine(0, self._crc)
                self._state, self._need = "signature", 4
                return True
        if self._name.endswith("/" + SERIALIZATION_ID):
            view = memoryview(self._serialization_id(bytes(view)))
        if ahead is not None:
            self.sink.write(view)
        else:
            self.sink.write_digest(view, self._digest)
        self._count += view.nbytes
        return False

    def _combine(self, given: int, written: int) -> None:
        """Mirror torch's writer, which combines the CRC field of every write that starts like a data descriptor.

        Args:
            given: What it saw (its CRC off).
            written: What torch.save would have seen.
        """
        self._combined_without = _hash_combine(self._combined_without, given)
        self._combined = _hash_combine(self._combined, written)

    def _serialization_id(self, data: bytes) -> bytes:
        """Rewrite torch's serialization id with the real CRCs.

        The id is 20 digits from the record names, then 20 from the records' CRCs combined as torch combines them
        (``c10::hash_combine``, see ``_combine``).

        Args:
            data: The id torch wrote (its CRCs were 0).

        Returns:
            The id with the last 20 digits from the real CRCs.

        Raises:
            ZipLayoutError: When ``data`` is not 40 bytes ending in the digits expected.
        """
        expected = f"{self._combined_without:020d}".encode()
        if len(data) != 40 or data[20:] != expected:
            raise ZipLayoutError(self._describe(f"a serialization id {data!r} not ending in {expected!r}"))
        return data[:20] + f"{self._combined:020d}".encode()

    def _digest(self, address: int, nbytes: int) -> None:
        self._crc = crc32((ctypes.c_char * nbytes).from_address(address), self._crc)

    def _header_part_complete(self) -> None:
        held = self._held
        if self._state == "signature":
            signature = bytes(held)
            if signature == _CENTRAL:
                self._state, self._need = "central", 46  # held until complete
                return
            if signature not in (_LOCAL, *_END):
                raise ZipLayoutError(self._describe(f"a part starting with {signature!r}"))
            self.sink.write(signature)
            self._held = bytearray()
            self._state, self._need = ("local", 30) if signature == _LOCAL else ("end", 0)
            if signature == _LOCAL:
                self._held += signature
            return
        if self._state == "local":
            if len(held) == 30:
                flags, method, crc, size, name_len, extra_len = struct.unpack_from("<HHxxxxII4xHH", held, 6)
                if method != 0 or crc != 0 or not (flags & 0x8 or size == 0):  # bit 3: a descriptor follows
                    raise ZipLayoutError(
                        self._describe(
                            f"a local header with flags {flags:#x}, method {method}, CRC {crc:#x}, size {size}"
                        )
                    )
                self._need = 30 + name_len + extra_len
                if self._need > 30:
                    return
            name_len = struct.unpack_from("<H", held, 26)[0]
            self._name = bytes(held[30 : 30 + name_len]).decode("utf-8")
            if self._name in self.crcs:
                raise ZipLayoutError(self._describe(f"the record name {self._name!r} twice"))
            if struct.unpack_from("<H", held, 6)[0] & 0x8:
                self._held, self._state, self._count, self._crc = bytearray(), "data", 0, 0
            else:  # an empty record, without a descriptor: its CRC is 0
                self.crcs[self._name] = 0
                self._held, self._state, self._need = bytearray(), "signature", 4
            return
        if len(held) == 46:  # a central directory entry
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", held, 28)
            self._need = 46 + name_len + extra_len + comment_len
            if self._need > 46:
                return
        name_len = struct.unpack_from("<H", held, 28)[0]
        name = bytes(held[46 : 46 + name_len]).decode("utf-8")
        if name not in self.crcs or name in self._patched or struct.unpack_from("<I", held, 16)[0] != 0:
            raise ZipLayoutError(self._describe(f"a central directory entry for {name!r} that matches no record"))
        struct.pack_into("<I", held, 16, self.crcs[name])
        self._patched.add(name)
        self.sink.write(held)
        self._held, self._state, self._need = bytearray(), "signature", 4

    def _describe(self, what: str) -> str:
        return (
            f"deepoffload.save cannot fill in the CRC-32 fields of {self.sink.path}: torch "
            f"{torch.__version__}'s zip writer produced {what}, which it does not know. Save with "
            f"checksum=False, or use torch.save"
        )


class ZipChecksums:
    """Verifies the CRC-32 of the zip records of a ``torch.save`` file as they are read.

    ``on_read(offset, view)`` checks a read that covers exactly one record's data; ``finish()`` checks, by plain
    reads, every record that was not read that way. A mismatch raises ``ChecksumError`` naming the record and file.

    Args:
        path: The ``torch.save`` file.

    Raises:
        ValueError: When the file is not in zip format (it has no checksums).
        ChecksumError: When the file recorded no checksums (saved with them off).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            archive = zipfile.ZipFile(path)
        except zipfile.BadZipFile as e:
            raise ValueError(
                f"{path}: not a zip-format torch.save file, so it has no checksums to verify; load it "
                f"with checksum=False"
            ) from e
        self._records: dict[int, zipfile.ZipInfo] = {}
        with archive, open(path, "rb") as f:
            for info in archive.infolist():
                f.seek(info.header_offset)
                header = f.read(30)
                name_bytes, extra_bytes = struct.unpack("<HH", header[26:30])
                self._records[info.header_offset + 30 + name_bytes + extra_bytes] = info
        unrecorded = [i.filename for i in self._records.values() if i.CRC == 0 and i.file_size > 0]
        if unrecorded:
            raise ChecksumError(
                errno.EIO,
                f"{path}: no checksums were recorded (saved with checksum=False or with torch's "
                f"crc32 option off; first record without one: {unrecorded[0]}); load it with "
                f"checksum=False",
            )
        self._verified: set[int] = set()

    def on_read(self, offset: int, view: memoryview) -> None:
        """Check a read that covers exactly one record's data (other reads are left to ``finish``).

        Args:
            offset: The read's file offset.
            view: The bytes read.
        """
        info = self._records.get(offset)
        if info is not None and view.nbytes == info.file_size:
            self._check(info, crc32(view))
            self._verified.add(offset)

    def verify_memory(self, data: torch.Tensor) -> None:
        """Check every record against ``data``, the whole file's bytes.

        Args:
            data: The whole file's bytes (uint8).

        Raises:
            ChecksumError: When a record runs past the end of ``data`` (a truncated file) or its CRC differs.
        """
        for offset, info in self._records.items():
            if offset + info.file_size > data.numel():
                raise ChecksumError(
                    errno.EIO,
                    f"{self.path}: record {info.filename} ends at byte {offset + info.file_size}, "
                    f"past the end of the file ({data.numel()} bytes): the checkpoint is truncated",
                )
            if info.file_size:
                piece = (ctypes.c_char * info.file_size).from_address(data.data_ptr() + offset)
                self._check(info, crc32(piece))
            else:
                self._check(info, 0)
            self._verified.add(offset)

    def finish(self) -> None:
        """Check, by plain reads, every record not yet verified (a mismatch raises ``ChecksumError``)."""
        with open(self.path, "rb") as f:
            for offset, info in self._records.items():
                if offset not in self._verified:
                    f.seek(offset)
                    self._check(info, crc32(f.read(info.file_size)))

    def _check(self, info: zipfile.ZipInfo, crc: int) -> None:
        if crc != info.CRC:
            raise ChecksumError(
                errno.EIO,
                f"{self.path}: record {info.filename} ({info.file_size} bytes) has CRC-32 "
                f"{crc:#010x}, the file recorded {info.CRC:#010x}: the checkpoint is corrupted",
            )
