"""What a save leaves on disk besides the checkpoint: file modes (temporaries private, a replaced file keeps its mode,
a new one gets the umask's) and what dead writers left (removed by the next save or run there, never a live one's).
Kills at every step of every save path are in tests/crash/."""

from __future__ import annotations

import gc
import json
import os
import re
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import deepoffload
from deepoffload.formats import save_file, save_sharded
from deepoffload.io import owners
from deepoffload.swap import dead_runs
from deepoffload.swap.folders import create_run_folder, keep_run_folder, remove_run_folder

TENSORS = {f"w{i}": torch.full((256,), float(i)) for i in range(3)}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def shard_set(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    return [index] + [folder / name for name in set(json.loads(index.read_text())["weight_map"].values())]


def dcp_save(folder: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from deepoffload.dcp import FileSystemWriter

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(TENSORS), storage_writer=FileSystemWriter(folder / "dcp", overwrite=True), no_dist=True)


SAVES = {  # name -> (save into folder, the files it makes)
    "save": (lambda f: deepoffload.save(TENSORS, f / "ckpt.pt"), lambda f: [f / "ckpt.pt"]),
    "save_file": (lambda f: save_file(TENSORS, f / "x.safetensors"), lambda f: [f / "x.safetensors"]),
    "save_sharded": (lambda f: save_sharded(TENSORS, f, max_shard_bytes=1024), shard_set),
    "dcp": (dcp_save, lambda f: sorted((f / "dcp").iterdir())),
}


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


@pytest.mark.parametrize("name", list(SAVES))
def test_a_new_checkpoint_gets_the_umasks_mode_and_a_replaced_one_keeps_its_own(name, scratch, umask_027):
    # save_file and save_sharded replaced a 0600 checkpoint with a 0644 one (readable by every local user)
    save, files = SAVES[name]
    save(scratch)
    assert {mode(p) for p in files(scratch)} == {0o640}
    for path in files(scratch):
        os.chmod(path, 0o600)
    save(scratch)
    assert {mode(p) for p in files(scratch)} == {0o600}


@pytest.mark.parametrize("name", list(SAVES))
def test_temporaries_are_private_while_they_are_written(name, scratch, monkeypatch):
    # deepoffload.save's temporary was 0644 for its whole write, also when the checkpoint was 0600
    seen = []
    adopt = owners.adopt_mode

    def spy(temporary, model):
        seen.append(mode(Path(temporary)))
        adopt(temporary, model)

    monkeypatch.setattr("deepoffload.formats.torch_zip.write_file.adopt_mode", spy)
    monkeypatch.setattr("deepoffload.formats.commit.adopt_mode", spy)
    monkeypatch.setattr("deepoffload.formats.writer.adopt_mode", spy)
    monkeypatch.setattr("deepoffload.dcp.adopt_mode", spy)
    SAVES[name][0](scratch)
    assert seen and set(seen) == {0o600}


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_next_save_removes_what_dead_writers_left_and_nothing_of_live_ones(scratch):
    pid = dead_pid()
    host = owners.host_id()
    dead = [
        scratch / f".ckpt.pt.tmp-{pid}.{owners.start_time(os.getpid())}.{host}-0123abcd",
        scratch / f".model.partial-{pid}.0.{host}-0123abcd-00001",
        scratch / f".model.partial-{pid}.0.{host}-0123abcd-index",
    ]
    live = [
        scratch / owners.temporary_name("ckpt.pt"),
        scratch / (owners.temporary_name("model", "partial") + "-1"),
        scratch / f".other.pt.tmp-{pid}.0.{host}-0123abcd",  # a dead writer's, but of another file
        scratch / f".ckpt.pt.tmp-{pid}.0.0badc0de-0123abcd",
    ]  # another host's (or container's): not judged here
    for path in dead + live:
        path.write_bytes(b"x" * 100)
    deepoffload.save(TENSORS, scratch / "ckpt.pt")
    assert not dead[0].exists() and dead[1].exists()
    save_sharded(TENSORS, scratch, max_shard_bytes=1024)
    assert not any(p.exists() for p in dead) and all(p.exists() for p in live)


def test_a_leftover_that_cannot_be_removed_does_not_stop_the_others(scratch):
    # the first unlink error (a directory under a temporary's name here) ended the cleaning of the whole folder
    pid, host = dead_pid(), owners.host_id()
    stuck = [scratch / f".ckpt.pt.tmp-{pid}.0.{host}-0000000{k}" for k in range(3)]
    files = [scratch / f".ckpt.pt.tmp-{pid}.0.{host}-1111111{k}" for k in range(3)]
    for path in stuck:
        (path / "inside").mkdir(parents=True)  # unlink fails (EISDIR), whatever order the folder lists them in
    for path in files:
        path.write_bytes(b"x")
    assert sorted(owners.remove_dead_temporaries(scratch, "ckpt.pt")) == files
    assert all(p.is_dir() for p in stuck) and not any(p.exists() for p in files)
    deepoffload.save(TENSORS, scratch / "ckpt.pt")  # and the save that asked goes on
    assert owners.remove_dead_temporaries(scratch / "missing", "ckpt.pt") == []


def test_a_process_id_reused_by_a_newer_process_is_not_the_writer():
    me = os.getpid()
    start = owners.start_time(me)
    assert owners.is_alive(me, start) and owners.is_alive(me, 0)
    if start:  # /proc tells start times here
        assert not owners.is_alive(me, start + 1)
    assert not owners.is_alive(dead_pid(), 0)


def test_the_next_run_removes_the_swap_folders_of_dead_processes_only(scratch):
    # a killed training run left its optimizer swap folder for good
    pid = dead_pid()
    host = owners.host_id()
    dead = scratch / f"deepoffload-rank0-{pid}.0.{host}-abc_12xy"
    (dead / "sub").mkdir(parents=True)
    (dead / "state.swp").write_bytes(b"x" * 100)
    (dead / dead_runs.RUN_MARKER).write_bytes(b"")  # what every run folder this library makes carries
    elsewhere = scratch / f"deepoffload-rank2-{pid}.0.0badc0de-abc_12xy"  # another host's, sharing the folder
    elsewhere.mkdir()
    kept = scratch / f"deepoffload-rank1-{pid}.0.{host}-kept1234"
    kept.mkdir()
    (kept / dead_runs.KEPT).write_text("")
    unknown = scratch / "deepoffload-rank0-oldstyle"  # no owner recorded: never touched
    unknown.mkdir()
    live = create_run_folder(str(scratch), 0)
    assert Path(live).name.startswith(f"deepoffload-rank0-{owners.process_token()}-")
    assert not dead.exists() and kept.exists() and unknown.exists() and elsewhere.exists()
    mine = create_run_folder(str(scratch), 1)
    assert os.path.isdir(live)  # this process's folder, in use
    keep_run_folder(mine)
    assert (Path(mine) / dead_runs.KEPT).exists()
    remove_run_folder(live)
    remove_run_folder(mine)


OFFLOAD_SAVE_WITH_CONFIG = """
import os, signal, sys, torch
from torch import nn
import deepoffload

folder, version, kill = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "kill"


class Config:  # what ParameterOffload.save takes from a Hugging Face config: save_pretrained(folder), in place
    def save_pretrained(self, target):
        with open(os.path.join(target, "config.json"), "w") as f:
            f.write('{"version": ')
            f.flush()
            if kill:  # the writer dies while config.json is half written
                os.kill(os.getpid(), signal.SIGKILL)
            f.write(str(version) + "}")


torch.manual_seed(version)
model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(2)])
model.config = Config()
off = deepoffload.offload_parameters(model, os.path.join(folder, "swap"))
off.save(os.path.join(folder, "ckpt"))
off.close(restore=False)
"""


def test_offload_save_killed_while_writing_the_config_leaves_the_old_config(scratch):
    # off.save let config.save_pretrained write config.json in place: a kill there left a half-written (or empty)
    # config.json, and the folder's earlier checkpoint no longer loaded with from_pretrained
    def run(version: int, kill: bool) -> int:
        args = [sys.executable, "-c", OFFLOAD_SAVE_WITH_CONFIG, str(scratch), str(version), "kill" if kill else "-"]
        return subprocess.run(args, capture_output=True, timeout=300).returncode

    config = scratch / "ckpt" / "config.json"
    assert run(1, kill=False) == 0
    os.chmod(config, 0o600)
    assert run(2, kill=True) == -9
    assert json.loads(config.read_text()) == {"version": 1}
    assert run(3, kill=False) == 0
    assert json.loads(config.read_text()) == {"version": 3} and mode(config) == 0o600
    assert sorted(p.name for p in (scratch / "ckpt").iterdir()) == ["config.json", "model.safetensors"]


def test_the_host_id_closes_the_files_it_reads(monkeypatch):
    monkeypatch.setattr(owners, "_host", None)  # computed once per process: compute it again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        host = owners.host_id()
        gc.collect()
    assert re.fullmatch(r"[0-9a-f]{8}", host)
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
