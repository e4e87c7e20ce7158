"""``retire.replace``: a large file replaced by a rename is freed on a background thread, under a hidden name owned
by this process, and nothing of it is left once that thread is done; where it cannot be done it is ``os.replace``."""

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import deepoffload
from deepoffload.io import owners, retire


@pytest.fixture
def small_threshold(monkeypatch):
    monkeypatch.setattr(retire, "RETIRE_MIN_BYTES", 1024)


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_the_old_file_waits_under_a_hidden_name_until_the_thread_frees_it(tmp_path, small_threshold, monkeypatch):
    target, new = tmp_path / "ckpt.pt", tmp_path / "new"
    target.write_bytes(b"old" * 1000)
    new.write_bytes(b"new" * 1000)
    release, unlink = threading.Event(), os.unlink

    def slow_unlink(path, *a, **k):
        release.wait(10)
        return unlink(path, *a, **k)

    monkeypatch.setattr(retire.os, "unlink", slow_unlink)
    retire.replace(str(new), str(target))
    assert target.read_bytes() == b"new" * 1000  # in place when replace returns
    aside = _hidden(tmp_path)
    assert len(aside) == 1 and aside[0].startswith(".ckpt.pt.old-")
    assert (tmp_path / aside[0]).read_bytes() == b"old" * 1000
    assert owners.remove_dead_temporaries(tmp_path, "ckpt.pt") == []  # its owner (this process) is alive
    release.set()
    retire.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_small_files_and_files_with_other_links_are_renamed_over(tmp_path, monkeypatch):
    (tmp_path / "small").write_bytes(b"x")
    (tmp_path / "a").write_bytes(b"y")
    linked = []
    monkeypatch.setattr(retire.os, "link", lambda *a: linked.append(a))
    retire.replace(str(tmp_path / "a"), str(tmp_path / "small"))
    monkeypatch.undo()
    os.link(tmp_path / "small", tmp_path / "other-link")
    monkeypatch.setattr(retire.os, "link", lambda *a: linked.append(a))
    monkeypatch.setattr(retire, "RETIRE_MIN_BYTES", 0)
    (tmp_path / "b").write_bytes(b"z")
    retire.replace(str(tmp_path / "b"), str(tmp_path / "small"))
    assert linked == [] and (tmp_path / "small").read_bytes() == b"z"


def test_without_hard_links_it_is_a_plain_rename(tmp_path, small_threshold, monkeypatch):
    def no_links(*a):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(retire.os, "link", no_links)
    (tmp_path / "t").write_bytes(b"o" * 2048)
    (tmp_path / "n").write_bytes(b"n" * 2048)
    retire.replace(str(tmp_path / "n"), str(tmp_path / "t"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"] and (tmp_path / "t").read_bytes() == b"n" * 2048


def test_a_failed_rename_leaves_the_target_and_no_second_name(tmp_path, small_threshold):
    (tmp_path / "t").write_bytes(b"o" * 2048)
    with pytest.raises(FileNotFoundError):
        retire.replace(str(tmp_path / "missing"), str(tmp_path / "t"))
    retire.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"] and (tmp_path / "t").read_bytes() == b"o" * 2048


def test_save_over_a_large_checkpoint_frees_it_in_the_background(tmp_path, small_threshold):
    import torch

    path = tmp_path / "c.pt"
    deepoffload.save({"w": torch.zeros(4096)}, path)
    deepoffload.save({"w": torch.ones(4096)}, path)
    assert torch.equal(torch.load(path)["w"], torch.ones(4096))
    retire.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_a_killed_process_s_old_file_is_removed_by_the_next_save(tmp_path):
    """A child links the old file aside and is killed before its thread unlinks it; the next save removes it."""
    path = tmp_path / "c.pt"
    code = f"""
import os, signal, torch, deepoffload
from deepoffload.io import retire
retire.RETIRE_MIN_BYTES = 0
retire._unlink_later = lambda p: os.kill(os.getpid(), signal.SIGKILL)
deepoffload.save({{"w": torch.zeros(8)}}, {str(path)!r})
deepoffload.save({{"w": torch.ones(8)}}, {str(path)!r})
"""
    child = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True)
    assert child.returncode == -9, child.stderr.decode()
    assert len(_hidden(tmp_path)) == 1 and _hidden(tmp_path)[0].startswith(".c.pt.old-")
    import torch

    deepoffload.save({"w": torch.full((8,), 2.0)}, path)
    retire.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]
    assert torch.equal(torch.load(path)["w"], torch.full((8,), 2.0))
