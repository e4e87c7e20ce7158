"""Saves into one folder that overlap: the folder's save lock (``deepoffload.io.folder_lock``) and DCP's in-progress
markers. The whole saves, one paused at each of its steps while the other runs, are in tests/crash/ (two_writers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from deepoffload.io import folder_lock, owners
from deepoffload.io.folder_lock import LOCK_NAME
from deepoffload.io.folder_lock import folder_lock as lock

TENSORS = {f"w{i}": torch.full((256,), float(i)) for i in range(3)}
HOLD = "import sys; from deepoffload.io.folder_lock import folder_lock\nwith folder_lock(sys.argv[1]):\n"


def holder(folder: Path, then: str = "    sys.stdin.read()") -> subprocess.Popen:
    """A process that holds ``folder``'s lock (until its stdin closes), once it has printed "held"."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD + "    print('held', flush=True)\n" + then, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(folder_lock.__file__).parents[2])),
    )
    assert child.stdout.readline() == "held\n"
    return child


def test_a_save_that_cannot_get_the_lock_names_the_folder_and_the_holder(scratch):
    child = holder(scratch)
    try:
        with pytest.raises(TimeoutError) as caught, lock(scratch, timeout=0.2):
            pass
        assert str(scratch) in str(caught.value) and f"process {child.pid} " in str(caught.value)
    finally:
        child.communicate("")
    with lock(scratch, timeout=0):  # released with the holder: free at once
        assert (scratch / LOCK_NAME).exists()
    assert not (scratch / LOCK_NAME).exists()  # the holder removes it


def test_a_killed_holder_blocks_nobody(scratch):
    child = holder(scratch)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (scratch / LOCK_NAME).exists()  # left behind, without a holder
    with lock(scratch, timeout=0):
        pass
    assert not (scratch / LOCK_NAME).exists()


def test_a_waiter_takes_the_lock_once_the_holder_releases_it(scratch, monkeypatch):
    waiting, inside = threading.Event(), []
    wait = folder_lock._wait

    def announced(seconds):
        waiting.set()
        wait(seconds)

    monkeypatch.setattr(folder_lock, "_wait", announced)

    def second():
        with lock(scratch, timeout=60):
            inside.append("second")

    with lock(scratch):
        inside.append("first")
        thread = threading.Thread(target=second)
        thread.start()
        waiting.wait(60)
        assert inside == ["first"]  # the second waits (threads of one process take turns too)
    thread.join(60)
    assert inside == ["first", "second"]


def test_a_waiter_holding_a_removed_lock_file_tries_again(scratch, monkeypatch):
    """B waits on the lock file A holds; A releases (removing the file); C locks a new file at the name before B's next
    try. B then gets the lock of the removed file, which must not count: it waits for C."""
    events = {name: threading.Event() for name in ("b_waits", "c_holds", "b_waits_again", "c_done")}
    holders: list[str] = []
    wait = folder_lock._wait

    def paced(seconds):
        if threading.current_thread().name == "B":
            if not events["b_waits"].is_set():
                events["b_waits"].set()
                events["c_holds"].wait(60)  # B's next try comes once C holds the new file's lock
            elif events["c_holds"].is_set() and not events["c_done"].is_set():
                events["b_waits_again"].set()
        wait(seconds)

    monkeypatch.setattr(folder_lock, "_wait", paced)

    def hold(name, until=None):
        with lock(scratch, timeout=60):
            holders.append(name)
            assert len(holders) == 1, f"{holders} hold the lock at once"
            if name == "C":
                events["c_holds"].set()
                events["b_waits_again"].wait(60)
                events["c_done"].set()
            holders.remove(name)

    b = threading.Thread(target=hold, args=("B",), name="B")
    c = threading.Thread(target=hold, args=("C",), name="C")
    with lock(scratch):
        b.start()
        events["b_waits"].wait(60)
    c.start()
    for thread in (b, c):
        thread.join(60)
    assert all(event.is_set() for event in events.values())
    assert holders == [] and not (scratch / LOCK_NAME).exists()


def test_a_link_in_place_of_the_lock_file_is_refused_and_not_followed(scratch):
    victim = scratch / "victim"
    victim.write_text("keep")
    (scratch / LOCK_NAME).symlink_to(victim)
    with pytest.raises(OSError, match="symbolic link") as caught, lock(scratch):
        pass
    assert str(scratch) in str(caught.value) and "remove it, then save again" in str(caught.value)
    assert victim.read_text() == "keep"
    (scratch / LOCK_NAME).unlink()  # as the message says
    with lock(scratch, timeout=0):
        pass


def test_something_else_in_place_of_the_lock_file_is_refused(scratch):
    os.mkfifo(scratch / LOCK_NAME)  # opening it for reading would block, and it is no lock file
    with pytest.raises(OSError, match="not a regular file .*remove it, then save again"), lock(scratch, timeout=0):
        pass
    (scratch / LOCK_NAME).unlink()
    (scratch / LOCK_NAME).mkdir()
    with pytest.raises(OSError, match="a folder is in its place .*remove it, then save again"), lock(scratch):
        pass


def test_a_sharded_save_that_cannot_get_the_lock_raises_and_leaves_the_old_checkpoint(scratch, monkeypatch):
    from deepoffload.formats import load_file, save_sharded

    save_sharded(TENSORS, scratch, max_shard_bytes=1024)
    before = sorted(os.listdir(scratch))
    monkeypatch.setattr(folder_lock, "TIMEOUT_S", 0.2)
    child = holder(scratch)
    try:
        with pytest.raises(TimeoutError, match=f"process {child.pid} ") as caught:
            save_sharded({name: t + 1 for name, t in TENSORS.items()}, scratch, max_shard_bytes=1024)
        assert str(scratch) in str(caught.value)
    finally:
        child.communicate("")
    assert sorted(os.listdir(scratch)) == before  # no temporaries left
    loaded = load_file(scratch)
    assert loaded.keys() == TENSORS.keys() and all(torch.equal(loaded[k], TENSORS[k]) for k in TENSORS)


# -- DCP: what a save removes after its switch --------------------------------------------------------------------
def dcp_save(folder: Path, tensors=TENSORS) -> None:
    import torch.distributed.checkpoint as dcp

    from deepoffload.dcp import FileSystemWriter

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(tensors), storage_writer=FileSystemWriter(folder, overwrite=True), no_dist=True)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_dcp_keeps_the_files_of_a_save_in_progress_and_removes_those_of_a_dead_one(scratch):
    dcp_save(scratch)
    assert not any(p.name.startswith(".__") for p in scratch.iterdir())  # a finished save's marker is gone
    host = owners.host_id()
    live_marker = scratch / owners.temporary_name("__aaaaaaaa", "partial")  # this process: a save in progress
    dead_marker = scratch / f".__bbbbbbbb.partial-{dead_pid()}.0.{host}-0123abcd"
    other_host = scratch / ".__cccccccc.partial-1.0.0badc0de-0123abcd"  # judged where it runs
    live, dead, remote = (scratch / f"__0_{g}_0.distcp" for g in ("aaaaaaaa", "bbbbbbbb", "cccccccc"))
    orphan = scratch / "__0_dddddddd_0.distcp"  # no marker: a finished save's, superseded
    for path in (live_marker, dead_marker, other_host, live, dead, remote, orphan):
        path.write_bytes(b"")
    dcp_save(scratch)
    assert all(p.exists() for p in (live_marker, other_host, live, remote))
    assert not any(p.exists() for p in (dead_marker, dead, orphan))


def test_a_failed_dcp_save_unmarks_its_generation_when_its_writer_goes(scratch, monkeypatch):
    import gc

    from torch.distributed.checkpoint.api import CheckpointException

    from deepoffload.dcp import FileSystemWriter

    def fail(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "finish", fail)
    with pytest.raises((OSError, CheckpointException), match="No space"):  # (DCP wraps it in its own)
        dcp_save(scratch)
    assert len([p for p in scratch.iterdir() if p.suffix == ".distcp"]) == 1  # written, never named
    gc.collect()
    assert not any(p.name.startswith(".__") for p in scratch.iterdir())
    monkeypatch.undo()
    dcp_save(scratch)  # and the next save removes the failed save's data file
    assert len([p for p in scratch.iterdir() if p.suffix == ".distcp"]) == 1


# -- lock files of other users, in shared folders ----------------------------------------------------------------------
def test_a_lock_file_the_save_may_not_remove_stays_and_the_save_succeeds(scratch, monkeypatch):
    """Another user's lock file, left by a killed save in a sticky folder (mode 1777): this user may lock it but not
    remove it. The save is done once its switch is; it must not report failure (nor may any later save)."""
    from deepoffload.formats import load_file, save_sharded

    unlink = os.unlink

    def sticky(path, *args, **kwargs):
        if Path(path).name == LOCK_NAME:
            raise PermissionError(1, "Operation not permitted", str(path))
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", sticky)
    for step in (1, 2):
        save_sharded({name: t + step for name, t in TENSORS.items()}, scratch, max_shard_bytes=1024)
        loaded = load_file(scratch)
        assert all(torch.equal(loaded[k], TENSORS[k] + step) for k in TENSORS)
    assert (scratch / LOCK_NAME).exists()


def test_a_lock_file_that_protected_regular_refuses_to_create_is_opened_as_it_is(scratch, monkeypatch):
    """With fs.protected_regular, Linux refuses O_CREAT on another user's file in a sticky folder, even read-only."""
    (scratch / LOCK_NAME).write_text("")
    real_open = os.open

    def protected(path, flags, *args, **kwargs):
        if Path(path).name == LOCK_NAME and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", protected)
    with lock(scratch, timeout=0):
        pass


def test_a_waiter_does_not_name_an_ended_process_as_the_holder(scratch):
    """A holder that may not write the lock file (another user's) leaves an earlier, ended holder's record in it."""
    child = holder(scratch)
    try:
        ended = dead_pid()
        (scratch / LOCK_NAME).write_text(f"{ended}.{owners.start_time(os.getpid())}.{owners.host_id()}")
        with pytest.raises(TimeoutError) as caught, lock(scratch, timeout=0.1):
            pass
        assert f"process {ended}" not in str(caught.value) and "could not record its id" in str(caught.value)
    finally:
        child.communicate("")


def test_one_dcp_writer_serving_an_async_save_and_a_save_that_overlap_it(scratch):
    """A training loop makes one writer and passes it to every save: the async save of step 1 is still finishing when
    step 2's save runs. Each save's in-progress mark is its own (one mark per writer lost step 1's: step 2's save
    removed step 1's data file, then step 1's .metadata named it, and the folder held no checkpoint)."""
    import torch.distributed.checkpoint as dcp

    from deepoffload.dcp import FileSystemReader, FileSystemWriter

    writer = FileSystemWriter(scratch, overwrite=True)
    paused, resume = threading.Event(), threading.Event()
    finish = writer.finish

    def paused_finish(metadata, results):  # step 1 has written its data file; it waits before its switch
        if not paused.is_set():
            paused.set()
            resume.wait(60)
        finish(metadata, results)

    writer.finish = paused_finish
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        step1 = dcp.async_save({"w": torch.full((64,), 1.0)}, storage_writer=writer, no_dist=True)
        assert paused.wait(60)
        dcp.save({"w": torch.full((64,), 2.0)}, storage_writer=writer, no_dist=True)
        resume.set()
        step1.result(60)
        state = {"w": torch.zeros(64)}
        dcp.load(state, storage_reader=FileSystemReader(scratch), no_dist=True)
    assert torch.equal(state["w"], torch.full((64,), 1.0))  # step 1 switched last
    assert len([p for p in scratch.iterdir() if p.suffix == ".distcp"]) == 1
    assert not any(p.name.startswith(".__") for p in scratch.iterdir())


def test_a_filesystem_without_flock_saves_unprotected_and_says_so(scratch, monkeypatch):
    """Lustre mounted without flock answers ENOSYS: saves there worked before the lock and must go on working."""
    import errno

    from deepoffload.formats import load_file, save_sharded

    def refused(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(folder_lock.fcntl, "flock", refused)
    with pytest.warns(UserWarning, match=f"saving into {scratch} without its save lock.*-o flock"):
        save_sharded(TENSORS, scratch, max_shard_bytes=1024)
    loaded = load_file(scratch)
    assert all(torch.equal(loaded[k], TENSORS[k]) for k in TENSORS)
    assert not (scratch / LOCK_NAME).exists()
