"""Swap folders another local user may have shaped: dead-run cleaning that a planted tree cannot turn against the
user (no recursion a tree's depth can overflow, no link followed, only this user's folders carrying the library's
marker, any error logged and passed over).

Tests that play the other user run as root and give folders to uid 65534 (``nobody``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from deepoffload import OffloadedOptimizer, SwapConfig, TensorSwapper
from deepoffload.errors import ChecksumError
from deepoffload.io import owners
from deepoffload.io.tree import remove_tree
from deepoffload.swap import dead_runs
from deepoffload.swap.folders import create_run_folder, remove_run_folder

OTHER_UID = 65534
DEPTH = 1500  # deeper than Python's recursion limit (1000): shutil.rmtree raised RecursionError
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")


def dead_name(rank: int = 0) -> str:
    """A run folder's name recording a process of this host that does not exist."""
    return f"deepoffload-rank{rank}-4194303999.0.{owners.host_id()}-abc_12xy"


def nest(folder: Path, depth: int) -> Path:
    """``depth`` nested folders under ``folder`` (made with relative steps: the full path would pass PATH_MAX)."""
    here = os.getcwd()
    os.chdir(folder)
    try:
        for _ in range(depth):
            os.mkdir("d")
            os.chdir("d")
        Path("deepest.swp").write_bytes(b"x")
    finally:
        os.chdir(here)
    return folder


@pytest.fixture
def planted(scratch):
    """Deep trees made by the test, removed after it without recursion (the scratch teardown's rmtree recurses)."""
    made: list[Path] = []
    yield made
    for folder in made:
        if folder.is_dir() and not folder.is_symlink():
            remove_tree(folder)


def plant(base: Path, made: list[Path], uid: int | None = None, marker: bool = True) -> Path:
    folder = base / dead_name()
    folder.mkdir()
    made.append(folder)
    if marker:
        (folder / dead_runs.RUN_MARKER).write_bytes(b"")
    nest(folder, DEPTH)
    if uid is not None:
        os.chown(folder, uid, uid)
    return folder


@as_root
def test_another_users_planted_deep_tree_does_not_stop_set_up(scratch, planted):
    made = planted
    # a 1500-deep "dead run" folder made TensorSwapper() and OffloadedOptimizer() raise RecursionError
    planted = plant(scratch, made, OTHER_UID)
    TensorSwapper(SwapConfig(folder=str(scratch), pin=False)).close()
    param = torch.nn.Parameter(torch.ones(4))
    OffloadedOptimizer(torch.optim.SGD([param], lr=0.1), config=SwapConfig(folder=str(scratch), pin=False)).close()
    assert planted.is_dir() and (planted / "d").is_dir()  # another user's: never entered


def test_a_dead_run_folder_of_this_user_is_removed_however_deep(scratch, planted):
    made = planted
    planted = plant(scratch, made)
    outside = scratch / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    (planted / "d" / "d" / "link").symlink_to(outside)
    (planted / "d" / "file-link").symlink_to(outside / "keep.txt")
    assert dead_runs.remove_dead_run_folders(scratch) == [planted]
    assert not planted.exists() and (outside / "keep.txt").read_text() == "mine"


def test_only_marked_folders_are_cleaned(scratch, planted):
    made = planted
    unmarked = plant(scratch, made, marker=False)  # a folder of the right name that the library did not make
    link = scratch / dead_name(1)
    link.symlink_to(unmarked)  # a link of the right name: removed never, followed never
    assert dead_runs.remove_dead_run_folders(scratch) == []
    assert unmarked.is_dir() and link.is_symlink()
    remove_tree(unmarked)
    assert not unmarked.exists()


def test_a_run_folder_carries_the_marker(scratch):
    folder = create_run_folder(str(scratch), 0)
    try:
        assert (Path(folder) / dead_runs.RUN_MARKER).is_file()
    finally:
        remove_run_folder(folder)
    assert not os.path.exists(folder)


def test_an_error_cleaning_leftovers_is_logged_and_passed_over(scratch, planted, monkeypatch, caplog):
    made = planted
    planted = plant(scratch, made)

    def broken(path, owner=None, last=None):
        raise RuntimeError("cannot happen, but must not stop set-up")

    monkeypatch.setattr(dead_runs, "remove_tree", broken)
    with caplog.at_level(logging.WARNING, logger="deepoffload"):
        swapper = TensorSwapper(SwapConfig(folder=str(scratch), pin=False))
    swapper.close()
    assert planted.is_dir()
    assert any(str(planted) in r.getMessage() and "RuntimeError" in r.getMessage() for r in caplog.records)


def test_remove_tree_refuses_a_link_and_another_owner(scratch):
    target = scratch / "target"
    target.mkdir()
    (scratch / "link").symlink_to(target)
    with pytest.raises(OSError):
        remove_tree(scratch / "link")
    assert target.is_dir() and (scratch / "link").is_symlink()
    with pytest.raises(PermissionError, match="owned by user"):
        remove_tree(target, owner=os.getuid() + 1)
    assert target.is_dir()


def test_a_crafted_process_id_is_a_dead_process():
    # a name recording a pid past a C int made os.kill raise OverflowError inside the cleaning
    assert not owners.is_alive(2**31, 0) and not owners.is_alive(2**70, 0)


# -- folders checked before use ----------------------------------------------------------------------------------


@as_root
def test_a_base_folder_another_user_owns_is_refused_unless_trusted(scratch):
    # a base folder made by another user (mode 1777) was accepted without a word
    base = scratch / "theirs"
    base.mkdir()
    os.chmod(base, 0o1777)
    os.chown(base, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError, match=r"is owned by .*uid 65534\) \(mode 1777\).*trust_folder_owner=True"):
        TensorSwapper(SwapConfig(folder=str(base), pin=False))
    param = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(PermissionError, match="uid 65534"):
        OffloadedOptimizer(torch.optim.SGD([param], lr=0.1), config=SwapConfig(folder=str(base), pin=False))
    assert list(base.iterdir()) == []  # refused before anything was made there
    trusted = TensorSwapper(SwapConfig(folder=str(base), pin=False, trust_folder_owner=True))  # the opt-in
    assert trusted.config.checksum  # turned on with it: bytes changed by the folder's owner are an error
    trusted.swap_out({"g": {"t": torch.ones(3)}}).wait()
    with open(os.path.join(trusted.folder, "g.swp"), "r+b") as f:
        f.write(b"\x00\x00\x00\x40")  # what the folder's owner could do: 1.0 -> 2.0
    with pytest.raises(ChecksumError):
        trusted.swap_in(["g"]).wait()
    trusted.close()


@as_root
def test_a_link_another_user_owns_at_the_base_name_is_refused(scratch):
    mine = scratch / "mine"
    mine.mkdir()
    link = scratch / "swap"
    link.symlink_to(mine)
    TensorSwapper(SwapConfig(folder=str(link), pin=False)).close()  # my own link: followed
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError, match=r"is a link owned by .*uid 65534"):
        TensorSwapper(SwapConfig(folder=str(link), pin=False))


def test_a_base_folder_everyone_may_change_without_the_sticky_bit_is_refused(scratch):
    base = scratch / "open"
    base.mkdir()
    os.chmod(base, 0o777)
    with pytest.raises(PermissionError, match=r"writable by every user without the sticky bit \(mode 0777\)"):
        TensorSwapper(SwapConfig(folder=str(base), pin=False))
    os.chmod(base, 0o1777)  # as /tmp: others cannot rename what is not theirs
    TensorSwapper(SwapConfig(folder=str(base), pin=False)).close()


def test_a_run_folder_replaced_by_a_link_is_detected(scratch):
    # a run folder replaced by a link to someone else's folder: the swap files went there, and came back from there
    swapper = TensorSwapper(SwapConfig(folder=str(scratch), pin=False))
    swapper.swap_out({"g": {"t": torch.ones(3)}}).wait()
    theirs = scratch / "theirs"
    theirs.mkdir()
    os.rename(swapper.folder, scratch / "moved-away")
    os.symlink(theirs, swapper.folder)
    with pytest.raises(PermissionError, match="is not the folder this run made: another folder or a link"):
        swapper.swap_out({"h": {"t": torch.ones(3)}})
    with pytest.raises(PermissionError, match="is not the folder this run made"):
        swapper.swap_in(["g"])
    with pytest.warns(UserWarning, match="left in place"):
        swapper.close()
    assert list(theirs.iterdir()) == [] and os.path.islink(swapper.folder)
    os.unlink(swapper.folder)
    remove_tree(scratch / "moved-away")


@pytest.mark.parametrize("packed", [False, True])
def test_swap_files_are_created_private(scratch, packed):
    old = os.umask(0)  # a permissive umask gave 0666 swap files (in a 0700 folder)
    try:
        swapper = TensorSwapper(SwapConfig(folder=str(scratch), pin=False), packed=packed)
        swapper.swap_out({"g": {"t": torch.ones(3)}, "empty": {}}).wait()
        names = [n for n in os.listdir(swapper.folder) if n.endswith(".swp")]
        assert names and all(os.stat(os.path.join(swapper.folder, n)).st_mode & 0o777 == 0o600 for n in names)
        assert os.stat(swapper.folder).st_mode & 0o777 == 0o700
        swapper.close()
    finally:
        os.umask(old)


def test_a_run_folder_that_is_not_private_is_refused_unless_trusted(scratch, monkeypatch):
    # a filesystem without permissions (vfat) shows every folder 0777: refused unless the user opts in
    from deepoffload.swap import folder_checks

    real_fstat = os.fstat

    def open_to_all(fd):
        st = real_fstat(fd)
        return os.stat_result((st.st_mode | 0o077, *tuple(st)[1:]))

    monkeypatch.setattr(folder_checks.os, "fstat", open_to_all)
    with pytest.raises(PermissionError, match="with mode 0777"):
        TensorSwapper(SwapConfig(folder=str(scratch), pin=False))
    monkeypatch.undo()
    assert [p.name for p in scratch.iterdir() if p.name.startswith("deepoffload-")]  # the refused folder stays
    monkeypatch.setattr(folder_checks.os, "fstat", open_to_all)
    TensorSwapper(SwapConfig(folder=str(scratch), pin=False, trust_folder_owner=True)).close()


def test_closing_after_the_run_folder_was_removed_warns_nothing(scratch, recwarn):
    swapper = TensorSwapper(SwapConfig(folder=str(scratch), pin=False))
    remove_tree(swapper.folder)
    swapper.close()
    assert not [w for w in recwarn if "left in place" in str(w.message)]


def test_remove_tree_removes_the_marker_last_so_a_killed_removal_is_cleaned_next_run(scratch, monkeypatch):
    """A run folder's marker is what dead-run cleaning looks for: removing the folder unlinks it after every other
    entry, also with os.unlink wrapped (as the crash harness wraps it: a wrapper is not in os.supports_dir_fd, which
    sent the removal to the fallback that removed the marker first, leaving an unmarked folder nobody cleaned)."""
    folder = scratch / "run"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.swp", "z.swp", "sub/b.swp", ".deepoffload-run"):
        (folder / name).write_bytes(b"x")
    order = []
    unlink = os.unlink

    def recording(name, *args, **kwargs):
        order.append(os.fsdecode(name))
        return unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", recording)
    remove_tree(folder, last=".deepoffload-run")
    assert not folder.exists()
    assert order[-1] == ".deepoffload-run" and len(order) == 4, order


def test_a_run_killed_before_its_marker_leaves_an_empty_folder_that_the_next_run_removes(scratch):
    """Killed between making its run folder and writing the marker, a run leaves an empty folder of its name: the next
    run removes it (rmdir removes nothing but an empty folder); an unmarked folder holding anything stays."""
    empty = scratch / dead_name()
    empty.mkdir()
    holding = scratch / dead_name(rank=1)
    holding.mkdir()
    (holding / "someone's file").write_bytes(b"x")
    live = scratch / f"deepoffload-rank0-{os.getpid()}.0.{owners.host_id()}-abc_12xy"  # a live owner's: kept
    live.mkdir()
    assert dead_runs.remove_dead_run_folders(scratch) == [empty]
    assert not empty.exists() and (holding / "someone's file").exists() and live.is_dir()


def test_the_open_folder_refusal_advice_works_for_each_entry_point(scratch):
    """Both ways out the refusal names: a folder of one's own inside it, or SwapConfig(trust_folder_owner=True)
    given as each entry point takes a SwapConfig (config=, and swap= for StorageCache)."""
    import re

    from torch import nn

    from deepoffload import StorageCache, offload_activations, offload_parameters

    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    base = scratch / "open"
    base.mkdir()
    os.chmod(base, 0o777)

    def activations(folder, swap):
        with offload_activations(folder, min_bytes=0, config=swap):
            nn.Linear(8, 8)(torch.randn(4, 8, requires_grad=True)).sum().backward()

    uses = {
        "config": lambda folder, swap: offload_parameters(nn.Sequential(nn.Linear(2, 2)), folder, config=swap).close(),
        "swap": lambda folder, swap: StorageCache(folder, config=hf, swap=swap).close(),
        "activations": activations,
    }
    for name, use in uses.items():
        with pytest.raises(PermissionError, match="writable by every user") as refused:
            use(str(base), None)
        message = str(refused.value)
        own = re.search(r"mkdir (\S+) and pass that", message).group(1)
        os.makedirs(own, mode=0o700, exist_ok=True)
        use(own, None)
        keyword = "swap" if name == "swap" else "config"
        assert f"as {keyword}=" in message, message
        use(str(base), SwapConfig(trust_folder_owner=True))
