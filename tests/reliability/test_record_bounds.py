"""Loaders check every record against the file before using its bytes: a storage larger (or smaller) than its
record, a safetensors shape whose zero size hides 64-bit overflow in the others, a bad safetensors header reached
through ``deepoffload.load``: each a ``CheckpointError`` naming the file and what is wrong, never a tensor holding
other bytes or a raw torch error."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import deepoffload
from deepoffload.errors import CheckpointError
from deepoffload.formats import load_file


@pytest.mark.parametrize("claimed", [70500, 69000])
def test_a_storage_that_is_not_its_records_size_is_refused(scratch, claimed):
    # deepoffload.load returned a tensor whose tail was zip metadata and the next record's bytes
    path = scratch / "x.pt"
    torch.save({"a": torch.zeros(70000), "b": torch.ones(10)}, path)
    raw = path.read_bytes()
    numel = b"J" + struct.pack("<i", 70000)  # BININT 70000: the storage's element count in data.pkl
    assert raw.count(numel) >= 1
    path.write_bytes(raw.replace(numel, b"J" + struct.pack("<i", claimed), 1))
    with pytest.raises(RuntimeError, match="does not match expected size"):
        torch.load(path)  # the reference refuses it too
    for mmap in (False, True):  # torch.load(mmap=True) does not refuse it: its tensor's storage runs on too
        with pytest.raises(CheckpointError, match=r"record data/0 holds 280000 bytes but the pickle claims") as info:
            deepoffload.load(path, mmap=mmap)
        assert str(path) in str(info.value)


def safetensors_file(path, header: dict, data: bytes = b"") -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [0, 2**64], [2**40, 0, 2**40]])
def test_a_zero_size_does_not_hide_an_overflowing_shape(scratch, shape):
    # passed validation, then failed in torch: "Overflow when unpacking long long", "Stride calculation overflowed"
    path = scratch / "z.safetensors"
    safetensors_file(path, {"x": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    for load in (load_file, deepoffload.load):
        with pytest.raises(CheckpointError, match="tensor 'x': shape .* overflows 64-bit sizes and strides"):
            load(path)


def test_zero_sized_tensors_with_sane_shapes_still_load(scratch):
    path = scratch / "ok.safetensors"
    safetensors_file(path, {"x": {"dtype": "F32", "shape": [0, 2**31, 7], "data_offsets": [0, 0]}})
    assert load_file(path)["x"].shape == (0, 2**31, 7)


def test_load_of_a_bad_safetensors_file_says_what_is_wrong_with_it(scratch):
    # deepoffload.load("x.safetensors") said "neither a zip-format nor a legacy torch.save file"
    path = scratch / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b'{"x": 1}')
    with pytest.raises(CheckpointError, match="not a valid safetensors file: header length 1000 runs past the end"):
        deepoffload.load(path)


def test_a_torch_checkpoint_read_as_a_model_source_is_checked_too(scratch):
    # CheckpointReader (from_pretrained of a pytorch_model.bin, offload_parameters(checkpoint=...)) mapped it with
    # torch.load(mmap=True), which does not refuse a storage larger than its record
    from deepoffload.formats import CheckpointReader

    path = scratch / "pytorch_model.bin"
    torch.save({"a": torch.zeros(70000), "b": torch.ones(10)}, path)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"J" + struct.pack("<i", 70000), b"J" + struct.pack("<i", 70500), 1))
    with pytest.raises(CheckpointError, match=r"record data/0 holds 280000 bytes but the pickle claims"):
        CheckpointReader(path)
