"""deepoffload.dcp: DCP's FileSystemWriter/FileSystemReader through the async-IO op, with FSDP2 on two gloo ranks.

Each rank trains a fully_shard model two steps, saves its sharded model and optimizer state with our writer and with
DCP's own, and loads each checkpoint back with the other side's reader into a freshly built model. The test then
loads the two-rank checkpoint into one process (resharding 2 -> 1) and compares with the gathered full state.
The test runs this file as a script in a fresh process that spawns the two ranks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

WORLD = 2


def build(seed: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model, optimizer, rank: int, steps: int = 2) -> None:
    import torch

    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        optimizer.zero_grad()
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        optimizer.step()


def same(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def worker(rank: int, folder: str, store: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    import deepoffload.dcp as ours

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        model, optimizer = build(0)
        train(model, optimizer, rank)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.save(state, storage_writer=ours.FileSystemWriter(os.path.join(folder, "ours")))
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(folder, "theirs")))
        result = {}
        for name, reader in (
            ("theirs_reads_ours", dcp.FileSystemReader(os.path.join(folder, "ours"))),
            ("ours_reads_theirs", ours.FileSystemReader(os.path.join(folder, "theirs"))),
            ("ours_reads_ours", ours.FileSystemReader(os.path.join(folder, "ours"))),
        ):
            fresh, fresh_optimizer = build(1)  # other weights, and optimizer state to overwrite
            train(fresh, fresh_optimizer, rank, steps=1)
            fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_optimizer)
            target = {"model": fresh_model_sd, "optim": fresh_optim_sd}
            dcp.load(target, storage_reader=reader)
            set_state_dict(fresh, fresh_optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
            loaded_model_sd, loaded_optim_sd = get_state_dict(fresh, fresh_optimizer)
            result[name] = same(loaded_model_sd, model_sd) and same(loaded_optim_sd, optim_sd)
        full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": full[0], "optim": full[1]}, os.path.join(folder, "full.pt"))
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()  # both ranks done before either tears gloo down (a rank aborted there once under load)
    finally:
        dist.destroy_process_group()


def launch(folder: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(folder, os.path.join(folder, "store")), nprocs=WORLD, join=True)


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, __file__, str(folder)], check=True, timeout=300, env=env)
    return folder


@pytest.mark.slow
def test_fsdp2_checkpoints_cross_load_bit_identical(two_rank_checkpoints):
    for rank in range(WORLD):
        result = json.loads((two_rank_checkpoints / f"rank{rank}.json").read_text())
        assert result == {"theirs_reads_ours": True, "ours_reads_theirs": True, "ours_reads_ours": True}, rank


@pytest.mark.slow
def test_fsdp2_rank_files_are_byte_identical_to_dcps(two_rank_checkpoints):
    # ours are named __<rank>_<generation>_<n>.distcp (each save its own names), DCP's __<rank>_<n>.distcp
    ours, theirs = two_rank_checkpoints / "ours", two_rank_checkpoints / "theirs"
    files = {re.sub(r"^(__\d+_)[0-9a-f]{8}_", r"\1", p.name): p for p in ours.iterdir() if p.suffix == ".distcp"}
    assert sorted(files) == sorted(p.name for p in theirs.iterdir() if p.suffix == ".distcp") and len(files) == WORLD
    for name, path in files.items():
        assert path.read_bytes() == (theirs / name).read_bytes(), name


@pytest.mark.slow
def test_reshard_two_ranks_to_one_process(two_rank_checkpoints):
    import torch
    import torch.distributed.checkpoint as dcp

    from deepoffload.dcp import FileSystemReader

    full = torch.load(two_rank_checkpoints / "full.pt")

    def empty_like(tree):
        if isinstance(tree, dict):
            return {k: empty_like(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [empty_like(v) for v in tree]
        return torch.full_like(tree, -7) if isinstance(tree, torch.Tensor) else tree

    for folder in ("ours", "theirs"):
        target = empty_like(full)
        dcp.load(target, storage_reader=FileSystemReader(two_rank_checkpoints / folder), no_dist=True)
        assert same(target, full), folder


def test_single_process_save_and_load_go_through_the_op(tmp_path, monkeypatch):
    import torch
    import torch.distributed.checkpoint as dcp

    from deepoffload.dcp import FileSystemReader, FileSystemWriter
    from deepoffload.io.staged_file import StagedReader, StagedWriter

    calls = {"write": 0, "read": 0}
    submit, advance = StagedWriter.submit, StagedReader._advance

    def counting_submit(self, **flags):
        calls["write"] += 1
        submit(self, **flags)

    def counting_advance(self, first):
        calls["read"] += 1
        advance(self, first)

    monkeypatch.setattr(StagedWriter, "submit", counting_submit)
    monkeypatch.setattr(StagedReader, "_advance", counting_advance)
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300_000, generator=g), "b": torch.arange(7), "step": 3, "name": "x"}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "ours"), no_dist=True)
    assert calls["write"] > 0
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "theirs"), no_dist=True)
    (ours,) = (tmp_path / "ours").glob("__0_*_0.distcp")  # __<rank>_<generation>_<n>.distcp
    assert ours.read_bytes() == (tmp_path / "theirs" / "__0_0.distcp").read_bytes()
    for folder in ("ours", "theirs"):
        target = {"w": torch.zeros(300_000), "b": torch.zeros(7, dtype=torch.int64), "step": 0, "name": ""}
        dcp.load(target, storage_reader=FileSystemReader(tmp_path / folder), no_dist=True)
        assert same(target, state), folder
    assert calls["read"] > 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_is_dcps_but_for_the_rank_file_names(tmp_path):
    """What is DCP's and what is not: the rank files hold DCP's bytes under per-save names, so .metadata records
    those names; all else in it is DCP's (but the path and random id that differ between any two of DCP's saves)."""
    import dataclasses
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from deepoffload.dcp import FileSystemWriter

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3000, generator=g), "b": torch.arange(7), "step": 3, "name": "x"}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "ours"), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "theirs"), no_dist=True)
    ours, theirs = ((tmp_path / side / ".metadata").read_bytes() for side in ("ours", "theirs"))
    assert ours != theirs
    ours, theirs = pickle.loads(ours), pickle.loads(theirs)
    (name,) = {info.relative_path for info in ours.storage_data.values()}
    assert re.fullmatch(r"__0_[0-9a-f]{8}_0\.distcp", name)
    renamed = {key: dataclasses.replace(info, relative_path="__0_0.distcp") for key, info in ours.storage_data.items()}
    assert renamed == theirs.storage_data
    assert (ours.state_dict_metadata, ours.planner_data, ours.version) == (
        theirs.state_dict_metadata,
        theirs.planner_data,
        theirs.version,
    )
    assert dataclasses.replace(ours.storage_meta, checkpoint_id=None, save_id=None) == dataclasses.replace(
        theirs.storage_meta, checkpoint_id=None, save_id=None
    )
    assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / "__0_0.distcp").read_bytes()


@pytest.mark.root
def test_disk_full_reaches_dcp_save(small_fs):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from deepoffload.dcp import FileSystemWriter

    folder = small_fs(8 << 20, "ext4")
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(4 << 20)}, storage_writer=FileSystemWriter(folder / "ckpt"), no_dist=True)
    assert "No space left on device" in str(info.value) and re.search(r"__0_[0-9a-f]{8}_0\.distcp", str(info.value))
    assert not (folder / "ckpt" / ".metadata").exists(), "no metadata: DCP will not take it for a checkpoint"
    assert os.listdir(folder / "ckpt") == [], "the failed file is removed"


if __name__ == "__main__":
    launch(*sys.argv[1:])
