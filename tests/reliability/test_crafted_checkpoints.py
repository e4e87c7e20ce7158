"""Crafted and damaged checkpoints raise ``CheckpointError`` naming the file and the record: a ``torch.save`` zip
whose central directory has a crafted size or offset, a local header that disagrees with it, a compressed record."""

from __future__ import annotations

import struct
import zipfile

import pytest
import torch

import deepoffload
from deepoffload.errors import CheckpointError

STATE = {"weight": torch.arange(6.0), "bias": torch.ones(3, dtype=torch.int16)}
_CENTRAL = struct.Struct("<4s6H3I5H2I")  # a central directory entry's fixed 46 bytes


def central_entries(data: bytes) -> dict[str, int]:
    """Record name -> where its central directory entry starts."""
    start = zipfile.ZipFile(__import__("io").BytesIO(data)).start_dir
    entries, position = {}, start
    while data[position : position + 4] == b"PK\x01\x02":
        fields = _CENTRAL.unpack_from(data, position)
        name_length, extra_length, comment_length = fields[10], fields[11], fields[12]
        name = data[position + 46 : position + 46 + name_length].decode()
        entries[name] = position
        position += 46 + name_length + extra_length + comment_length
    return entries


def craft(path, name_suffix: str, field_offset: int, value: int, fmt: str = "<I") -> bytes:
    data = bytearray(path.read_bytes())
    entry = next(at for name, at in central_entries(bytes(data)).items() if name.endswith(name_suffix))
    struct.pack_into(fmt, data, entry + field_offset, value)
    return bytes(data)


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize(
    "what,field_offset,value",
    [
        ("compressed size", 20, 1 << 31),
        ("uncompressed size", 24, 1 << 31),
        ("both sizes, larger", 20, None),
        ("local header offset", 42, 1),
        ("local header offset past the end", 42, 1 << 30),
    ],
)
def test_a_crafted_central_directory_raises_checkpoint_error_naming_path_and_record(
    scratch, mmap, what, field_offset, value
):
    # a crafted size or offset raised a bare RuntimeError ("PytorchStreamReader failed ...") without the path
    path = scratch / "ckpt.pt"
    torch.save(STATE, path)
    if value is None:  # both sizes grown by the same amount: consistent, but into the next record
        data = craft(path, "data/0", 20, 24 + 64)
        path.write_bytes(data)
        data = craft(path, "data/0", 24, 24 + 64)
    else:
        data = craft(path, "data/0", field_offset, value)
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=f"cannot load {path}: .*data/0"):
        deepoffload.load(path, mmap=mmap)


def test_a_crafted_directory_offset_is_refused(scratch):
    path = scratch / "ckpt.pt"
    torch.save(STATE, path)
    data = bytearray(path.read_bytes())
    end, end64 = data.rindex(b"PK\x05\x06"), data.rindex(b"PK\x06\x06")  # torch writes both end records
    struct.pack_into("<I", data, end + 16, struct.unpack_from("<I", data, end + 16)[0] + 46)
    struct.pack_into("<Q", data, end64 + 48, struct.unpack_from("<Q", data, end64 + 48)[0] + 46)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"cannot load {path}"):
        deepoffload.load(path)


def test_a_compressed_record_is_refused_not_sliced(scratch):
    # storages are sliced from the file's bytes: a deflated record would have been handed out compressed
    plain = scratch / "plain.pt"
    torch.save({"x": torch.zeros(4096)}, plain)
    rezipped = scratch / "rezipped.pt"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(rezipped, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info.filename))
    with pytest.raises(CheckpointError, match=r"rezipped.pt: record .*compressed"):
        deepoffload.load(rezipped)
    assert torch.equal(deepoffload.load(plain)["x"], torch.zeros(4096))


@pytest.mark.parametrize("writer", ["torch", "deepoffload", "deepoffload-checksum"])
def test_files_torch_and_deepoffload_write_pass_the_layout_check(scratch, writer):
    path = scratch / "ok.pt"
    state = {**STATE, "empty": torch.empty(0), "big": torch.ones(70000)}
    if writer == "torch":
        torch.save(state, path)
    else:
        deepoffload.save(state, path, checksum=writer.endswith("checksum"))
    for mmap in (False, True):
        back = deepoffload.load(path, mmap=mmap)
        assert all(torch.equal(back[k], v) for k, v in state.items())
    back = deepoffload.load(path, map_location=lambda storage, _: storage)  # read as a stream
    assert torch.equal(back["big"], state["big"])


def test_a_record_torchs_reader_refuses_is_a_checkpoint_error(scratch):
    # torch's zip reader raised "[enforce fail at inline_container.cc] Couldn't parse the version" without the path
    path = scratch / "ckpt.pt"
    torch.save(STATE, path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/version"))
    start = info.header_offset + 30 + int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
    start += int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    data[start : start + 1] = b"x"  # the version record's bytes: "x\n"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"cannot load {path}: .*version"):
        deepoffload.load(path)


@pytest.mark.parametrize("mmap", [False, True])
def test_a_zip_whose_first_header_is_damaged_is_a_checkpoint_error(scratch, mmap):
    # found by the fuzz test: with its first bytes changed the file was read as a legacy pickle (UnpicklingError) or,
    # with mmap=True, refused by torch with a RuntimeError
    path = scratch / "ckpt.pt"
    torch.save(STATE, path)
    data = bytearray(path.read_bytes())
    data[0:2] = b"\x80\x00"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"cannot load {path}: it ends as a zip-format .* damaged"):
        deepoffload.load(path, mmap=mmap)
