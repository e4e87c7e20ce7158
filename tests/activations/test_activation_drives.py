"""``offload_activations(path=[a, b])``: saved activations spread over several drives (a run folder, a file and an IO
queue on each), gradients bit-identical to one folder, every drive's files removed at the exit and after a crash, a
full drive named in the error with the tensors kept in memory. Drives are loop-device filesystems or tmpfs mounts
(``tests/support/drives.py``: root only, skipped with the reason elsewhere); folders on one device are one drive."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from deepoffload import offload_activations
from tests.support.drives import Drives, unavailable
from tests.support.killed import run_until_killed

from .helpers import config, grads, same
from .test_offload_activations import mlp

MiB = 1 << 20
pytestmark = pytest.mark.filterwarnings("ignore:swap folder .* is on tmpfs:UserWarning")


def run_folders(folders):
    return [name for folder in folders for name in os.listdir(folder) if name.startswith("deepoffload-")]


def offloaded_step(model, x, path, **kwargs):
    kwargs.setdefault("config", config())
    with offload_activations(path, min_bytes=0, **kwargs) as off:
        loss = model(x).sum()
        sizes = [os.path.getsize(os.path.join(f, "activations.swp")) for f in off.folders]
        loss.backward()
    return grads(model), off, sizes


@pytest.mark.skipif(unavailable("loop") is not None, reason=str(unavailable("loop")))
def test_two_drives_hold_the_saved_tensors_and_the_gradients_are_those_of_one_folder(scratch):
    model, x = mlp(), torch.randn(512, 256)
    one, _, _ = offloaded_step(model, x, str(scratch))
    with Drives(2, size=64 * MiB) as drives:
        two, off, sizes = offloaded_step(model, x, list(drives.folders))
        assert same(one, two)
        assert len(off.folders) == 2 and all(size > 0 for size in sizes), sizes  # both drives were written
        assert off.store is not None and all(s.bytes_read > 0 for s in off.store.stores), "read back from both"
        assert len({id(s.handle) for s in off.store.stores}) == 2, "a queue per drive"
        assert run_folders(drives.folders) == [], "every drive's run folder is removed at the exit"


def test_folders_on_one_device_are_one_drive(scratch):
    model, x = mlp(), torch.randn(512, 256)
    plain = model(x).sum().backward() or grads(model)
    a, b = scratch / "a", scratch / "b"
    a.mkdir(), b.mkdir()
    with pytest.warns(UserWarning, match="same device"):
        offloaded, off, _ = offloaded_step(model, x, [str(a), str(b)])
    assert same(plain, offloaded) and len(off.folders) == 1
    assert run_folders([a, b]) == []


def test_a_missing_folder_is_named_at_the_entry(scratch):
    missing = str(scratch / "not-mounted")
    with pytest.raises(FileNotFoundError, match="not-mounted"):
        with offload_activations([str(scratch), missing], config=config()):
            pass
    assert run_folders([scratch]) == [], "the folder made on the other drive is removed again"


@pytest.mark.skipif(unavailable("tmpfs") is not None, reason=str(unavailable("tmpfs")))
def test_a_crashed_runs_folders_are_removed_from_every_drive_by_the_next_run():
    with Drives(2, size=64 * MiB, kind="tmpfs") as drives:
        code = (
            "import os, signal, torch, deepoffload\n"
            "from tests.activations.test_offload_activations import mlp\n"
            f"off = deepoffload.offload_activations({list(drives.folders)!r}, min_bytes=0)\n"
            "with off:\n"
            "    loss = mlp()(torch.randn(512, 256)).sum()\n"
            "    print(*off.folders, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        left = run_until_killed(code).split()
        assert len(left) == 2 and all(os.path.getsize(os.path.join(f, "activations.swp")) > 0 for f in left)
        with offload_activations(list(drives.folders), config=config()):
            assert not any(os.path.exists(f) for f in left), "the dead run's folders went from both drives"


@pytest.mark.skipif(unavailable("tmpfs") is not None, reason=str(unavailable("tmpfs")))
def test_a_full_drive_is_named_and_its_tensors_stay_in_memory(scratch):
    model, x = mlp(), torch.randn(1024, 256)  # about 14 MiB of saved activations
    one, _, _ = offloaded_step(model, x, str(scratch))
    with Drives(2, size=2 * MiB, kind="tmpfs") as drives:
        with pytest.raises(OSError) as info:
            with offload_activations(list(drives.folders), min_bytes=0, config=config()) as off:
                loss = model(x).sum()
        error = info.value
        assert error.errno == errno.ENOSPC, error
        assert any(error.filename.startswith(f + os.sep) for f in drives.folders), error.filename
        assert off.stats()["kept"] > 0
        loss.backward()
        assert same(one, grads(model))
        del loss
        assert run_folders(drives.folders) == []
