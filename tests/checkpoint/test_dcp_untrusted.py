"""deepoffload.dcp.FileSystemReader reads only inside its folder and runs no pickle payload: a crafted ``.metadata``
naming ``../x.distcp``, an absolute path or a link out of the folder, or carrying a payload, raises a
``CheckpointError`` naming the entry (inside DCP's ``CheckpointException``), where DCP's own reader reads the file or
runs the payload; checkpoints written by DCP's own writer and ours still load; ``trust_metadata=True`` is the
documented opt-out for a metadata holding classes of one's own."""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import deepoffload.dcp
from deepoffload.dcp import FileSystemReader, FileSystemWriter
from deepoffload.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns about loading without a process group
STATE = {"weight": torch.arange(6.0), "step": 7, "bias": torch.ones(3, dtype=torch.bfloat16)}


def target() -> dict:
    return {"weight": torch.zeros(6), "step": 0, "bias": torch.zeros(3, dtype=torch.bfloat16)}


def save(folder, writer: str = "ours") -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = FileSystemWriter(folder) if writer == "ours" else dcp.FileSystemWriter(folder)
        dcp.save(STATE, storage_writer=storage, no_dist=True)


def load(folder, **kwargs) -> dict:
    state = target()
    dcp.load(state, storage_reader=FileSystemReader(folder, **kwargs), no_dist=True)
    return state


def refusal(folder, **kwargs) -> CheckpointError:
    """The CheckpointError deepoffload.dcp.load raises; dcp.load with the reader reports the same refusal."""
    with pytest.raises(CheckpointError) as info:
        deepoffload.dcp.load(target(), folder, no_dist=True, **kwargs)
    reader = FileSystemReader(folder, **kwargs)
    with pytest.raises(CheckpointException, match=re.escape(str(info.value))):
        dcp.load(target(), storage_reader=reader, no_dist=True)
    assert str(reader.refusal) == str(info.value)
    return info.value


def rewrite_metadata(folder, change) -> None:
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def point_weight_at(name: str):
    def change(metadata):
        for index, info in list(metadata.storage_data.items()):
            if index.fqn == "weight":
                metadata.storage_data[index] = dataclasses.replace(info, relative_path=name)

    return change


@pytest.mark.parametrize("writer", ["ours", "torch"])
def test_checkpoints_of_both_writers_load(tmp_path, writer):
    save(tmp_path / "ckpt", writer)
    state = load(tmp_path / "ckpt")
    assert torch.equal(state["weight"], STATE["weight"]) and state["step"] == 7
    assert torch.equal(state["bias"], STATE["bias"])


@pytest.mark.parametrize("where", ["parent", "absolute", "link"])
def test_an_entry_naming_a_file_outside_the_folder_is_refused(tmp_path, where):
    # DCP's own reader (and ours before) opened ../x.distcp, absolute paths and links out of the folder
    save(tmp_path / "ckpt")
    data_file = next(p for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".distcp")
    outside = tmp_path / "x.distcp"
    outside.write_bytes(data_file.read_bytes())  # a readable copy: only the path is wrong
    name = {"parent": "../x.distcp", "absolute": str(outside), "link": "inside.distcp"}[where]
    if where == "link":
        (tmp_path / "ckpt" / "inside.distcp").symlink_to(outside)
    rewrite_metadata(tmp_path / "ckpt", point_weight_at(name))
    state = target()
    dcp.load(state, storage_reader=dcp.FileSystemReader(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(state["weight"], STATE["weight"])  # DCP's reader read the file outside
    error = refusal(tmp_path / "ckpt")
    assert "'weight'" in str(error) and "outside the checkpoint's folder" in str(error)
    assert str(tmp_path / "ckpt" / ".metadata") in str(error)


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_pickle_payload_in_the_metadata_does_not_run(tmp_path):
    save(tmp_path / "ckpt")
    marker = tmp_path / "payload-ran"
    rewrite_metadata(tmp_path / "ckpt", lambda m: setattr(m, "planner_data", Payload(str(marker))))
    error = refusal(tmp_path / "ckpt")
    assert "posix.mkdir is not a class DCP's metadata is made of" in str(error) and not marker.exists()
    assert "trust_metadata=True" in str(error)
    dcp.load(target(), storage_reader=dcp.FileSystemReader(tmp_path / "ckpt"), no_dist=True)
    assert marker.exists()  # DCP's own reader ran it


def test_a_memo_index_running_ahead_is_refused_before_unpickling(tmp_path):
    """A crafted LONG_BINPUT makes the C unpickler grow and clear its memo up to the index named (the fuzz test found
    one asking for 8 GiB); an index past the objects stored so far is refused before anything is unpickled."""
    save(tmp_path / "ckpt")
    metadata = tmp_path / "ckpt" / ".metadata"
    body = metadata.read_bytes()
    assert body[:2] == b"\x80" + bytes([body[1]]) and body.endswith(b".")
    # PUT of the whole object at index 2**24 just before STOP: 128 MiB of memo without the check
    metadata.write_bytes(body[:-1] + b"r" + (2**24).to_bytes(4, "little") + b".")
    error = refusal(tmp_path / "ckpt")
    assert "memo index 16777216" in str(error) and "runs ahead" in str(error)


@dataclasses.dataclass
class Mine:
    note: str


def test_trust_metadata_reads_classes_of_ones_own(tmp_path):
    save(tmp_path / "ckpt")
    rewrite_metadata(tmp_path / "ckpt", lambda m: setattr(m.storage_meta, "modules", [Mine("kept")]))
    assert "Mine is not a class" in str(refusal(tmp_path / "ckpt"))
    state = load(tmp_path / "ckpt", trust_metadata=True)
    assert torch.equal(state["weight"], STATE["weight"])


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda m: setattr(m, "storage_data", None), "storage_data is a NoneType"),
        (
            lambda m: [
                m.storage_data.__setitem__(i, dataclasses.replace(v, length=v.length + 10**9))
                for i, v in list(m.storage_data.items())
                if i.fqn == "weight"
            ],
            "storage entry 'weight' reads bytes",
        ),
        (
            lambda m: [
                m.storage_data.__setitem__(i, dataclasses.replace(v, offset=-1))
                for i, v in list(m.storage_data.items())
                if i.fqn == "weight"
            ],
            "storage entry 'weight' reads bytes -1",
        ),
        (
            lambda m: m.state_dict_metadata["weight"].chunks[0].__setattr__("sizes", torch.Size([7])),
            "outside its shape",
        ),
    ],
)
def test_malformed_entries_are_refused_naming_them(tmp_path, change, words):
    save(tmp_path / "ckpt")
    rewrite_metadata(tmp_path / "ckpt", change)
    assert words in str(refusal(tmp_path / "ckpt"))


def test_deepoffload_dcp_load_raises_other_failures_as_checkpoint_errors(tmp_path):
    # DCP's planner refusal (a key the checkpoint lacks) came as a CheckpointException, a BaseException
    save(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"cannot load the DCP checkpoint .*Missing key in checkpoint .*extra"):
        deepoffload.dcp.load({**target(), "extra": torch.zeros(1)}, tmp_path / "ckpt", no_dist=True)
    state = target()
    deepoffload.dcp.load(state, tmp_path / "ckpt", no_dist=True)
    assert torch.equal(state["weight"], STATE["weight"])
