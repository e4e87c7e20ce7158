"""``retire.replace``: a large file replaced by a rename is held open across it and freed by a close on a background
thread; nothing of it is ever left on disk (not even when the process is killed), and where it cannot be held the
call is ``os.replace``."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import deepoffload
from deepoffload.io import retire


@pytest.fixture
def small_threshold(monkeypatch):
    monkeypatch.setattr(retire, "RETIRE_MIN_BYTES", 1024)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _held_files() -> list[str]:
    """The paths of this process's descriptors that point at deleted files."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(" (deleted)"):
            out.append(target)
    return out


def test_the_old_file_is_freed_by_the_background_close(tmp_path, small_threshold, monkeypatch):
    target, new = tmp_path / "ckpt.pt", tmp_path / "new"
    target.write_bytes(b"old" * 1000)
    new.write_bytes(b"new" * 1000)
    release, closed, close = threading.Event(), [], os.close

    def slow_close(fd):
        release.wait(10)
        closed.append(fd)
        return close(fd)

    monkeypatch.setattr(retire.os, "close", slow_close)
    fds = _open_fds()
    retire.replace(str(new), str(target))
    assert target.read_bytes() == b"new" * 1000  # in place when replace returns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no second name, ever
    assert [p for p in _held_files() if p.startswith(str(tmp_path))] == [f"{target} (deleted)"]
    assert closed == []
    release.set()
    retire.wait()
    assert len(closed) == 1 and _open_fds() == fds  # the one descriptor it held, closed
    assert [p for p in _held_files() if p.startswith(str(tmp_path))] == []


def test_small_files_and_files_with_other_links_are_not_held(tmp_path, monkeypatch):
    (tmp_path / "small").write_bytes(b"x")
    (tmp_path / "a").write_bytes(b"y")
    fds = _open_fds()
    retire.replace(str(tmp_path / "a"), str(tmp_path / "small"))
    assert _open_fds() == fds and retire._pending == set()
    monkeypatch.setattr(retire, "RETIRE_MIN_BYTES", 0)
    os.link(tmp_path / "small", tmp_path / "other-link")
    (tmp_path / "b").write_bytes(b"z")
    retire.replace(str(tmp_path / "b"), str(tmp_path / "small"))
    assert _open_fds() == fds and retire._pending == set()
    assert (tmp_path / "small").read_bytes() == b"z" and (tmp_path / "other-link").read_bytes() == b"y"


def test_an_unreadable_file_is_renamed_over(tmp_path, small_threshold, monkeypatch):
    def refuse(path, flags, *a):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(retire.os, "open", refuse)
    (tmp_path / "t").write_bytes(b"o" * 2048)
    (tmp_path / "n").write_bytes(b"n" * 2048)
    retire.replace(str(tmp_path / "n"), str(tmp_path / "t"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"] and (tmp_path / "t").read_bytes() == b"n" * 2048
    assert retire._pending == set()


def test_a_failed_rename_leaves_the_target_and_holds_nothing(tmp_path, small_threshold):
    (tmp_path / "t").write_bytes(b"o" * 2048)
    fds = _open_fds()
    with pytest.raises(FileNotFoundError):
        retire.replace(str(tmp_path / "missing"), str(tmp_path / "t"))
    retire.wait()
    assert _open_fds() == fds
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"] and (tmp_path / "t").read_bytes() == b"o" * 2048


def test_save_over_a_large_checkpoint_frees_it_in_the_background(tmp_path, small_threshold):
    import torch

    path = tmp_path / "c.pt"
    deepoffload.save({"w": torch.zeros(4096)}, path)
    deepoffload.save({"w": torch.ones(4096)}, path)
    assert torch.equal(torch.load(path)["w"], torch.ones(4096))
    retire.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]
    assert [p for p in _held_files() if p.startswith(str(tmp_path))] == []


def test_a_process_killed_before_the_close_leaves_nothing(tmp_path):
    """A child replaces a checkpoint and is killed while it still holds the old one: the kernel frees it."""
    path = tmp_path / "c.pt"
    code = f"""
import os, signal, torch, deepoffload
from deepoffload.io import retire
retire.RETIRE_MIN_BYTES = 0
retire._close_later = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
deepoffload.save({{"w": torch.zeros(8)}}, {str(path)!r})
deepoffload.save({{"w": torch.ones(8)}}, {str(path)!r})
"""
    child = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True)
    assert child.returncode == -9, child.stderr.decode()
    import torch

    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]
    assert torch.equal(torch.load(path)["w"], torch.ones(8))
