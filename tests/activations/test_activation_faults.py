"""``offload_activations`` under faults and unusual use: a full disk (the tensors stay in memory; the error, with
path, offset and errno, raised once at the backward or at the exit), a file changed under the run (``ChecksumError``),
writes still in flight when the backward needs the tensor (served from memory), a crashed run's folder (removed by
the next run), nested contexts (the inner one takes the tensors) and threads (one context per thread; a context is
entered once)."""

from __future__ import annotations

import errno
import os
import threading
import warnings

import pytest
import torch
from torch import nn

from deepoffload import ChecksumError, UnsupportedError, offload_activations
from deepoffload.io.request import Request
from tests.support.killed import run_until_killed

from .helpers import config, grads, same
from .test_offload_activations import mlp

MiB = 1 << 20


def step_and_grads(model, x, folder=None, **kwargs):
    """Gradients of one step, plain (``folder`` None) or inside offload_activations."""
    if folder is None:
        model(x).sum().backward()
        return grads(model), None
    kwargs.setdefault("config", config())
    with offload_activations(str(folder), min_bytes=0, **kwargs) as off:
        model(x).sum().backward()
    return grads(model), off


def test_full_disk_keeps_the_tensors_and_raises_at_the_exit_then_the_backward_is_identical(small_fs):
    folder = small_fs(3 * MiB, "ext4")
    model, x = mlp(), torch.randn(1024, 256)  # about 14 MiB of saved activations
    plain, _ = step_and_grads(model, x)
    with pytest.raises(OSError) as info:
        with offload_activations(str(folder), min_bytes=0, config=config()) as off:
            loss = model(x).sum()
    error = info.value
    assert error.errno == errno.ENOSPC and "activations.swp" in error.filename, error
    assert "at offset" in str(error) and "stays in memory" in str(error), error
    assert off.stats()["kept"] > 0, "after the failure, saved tensors stay in memory"
    loss.backward()  # raised once: the backward serves the tensors kept in memory
    assert same(plain, grads(model))
    del loss
    assert not [name for name in os.listdir(folder) if name.startswith("deepoffload-")], "folder removed"


def test_full_disk_raises_at_the_backward_inside_the_context(small_fs):
    folder = small_fs(3 * MiB, "ext4")
    model, x = mlp(), torch.randn(1024, 256)
    with pytest.raises(OSError) as info:
        with offload_activations(str(folder), min_bytes=0, config=config()):
            model(x).sum().backward()
    assert info.value.errno == errno.ENOSPC and "offset" in str(info.value)
    assert info.value.filename.startswith(str(folder)) and info.value.filename.endswith("activations.swp")


def test_a_file_changed_under_the_run_raises_checksum_error(scratch):
    model, x = mlp(), torch.randn(512, 256)
    with offload_activations(str(scratch), min_bytes=0, config=config()) as off:
        loss = model(x).sum()
    path = os.path.join(off.folder, "activations.swp")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(os.urandom(size))
    with pytest.raises(ChecksumError, match="changed on storage") as info:
        loss.backward()
    assert info.value.filename == path and info.value.errno == errno.EIO


def test_a_tensor_still_being_written_is_served_from_memory(scratch, monkeypatch):
    model, x = mlp(), torch.randn(512, 256)
    plain, _ = step_and_grads(model, x)
    monkeypatch.setattr(Request, "done", lambda self: False)  # no write is ever seen complete before a wait
    offloaded, off = step_and_grads(model, x, scratch)
    assert same(plain, offloaded)
    assert off is not None and off.stats()["served_from_memory"] > 0, off.stats() if off else None


def test_a_crashed_runs_folder_is_removed_by_the_next_run(scratch):
    code = (
        "import os, signal, torch, deepoffload\n"
        "from tests.activations.test_offload_activations import mlp\n"
        f"off = deepoffload.offload_activations({str(scratch)!r}, min_bytes=0)\n"
        "with off:\n"
        "    loss = mlp()(torch.randn(512, 256)).sum()\n"
        "    print(off.folder, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    left = run_until_killed(code).strip()
    assert os.path.isdir(left) and os.path.getsize(os.path.join(left, "activations.swp")) > 0
    with offload_activations(str(scratch), config=config()):
        assert not os.path.exists(left), "the dead run's folder went when the next run started"


def test_nested_contexts_the_inner_one_takes_the_tensors(scratch):
    model, x = mlp(), torch.randn(512, 256)
    plain, _ = step_and_grads(model, x)
    with offload_activations(str(scratch), min_bytes=0, config=config()) as outer:
        with offload_activations(str(scratch), min_bytes=0, config=config()) as inner:
            model(x).sum().backward()
        model(x).sum().backward()
    assert inner.stats()["written"] > 0 and outer.stats()["written"] == inner.stats()["written"]
    assert same([2 * g for g in plain], grads(model))


def test_a_context_is_entered_once_on_any_thread(scratch):
    off = offload_activations(str(scratch), config=config())
    with off:
        with pytest.raises(UnsupportedError, match="entered once"):
            off.__enter__()
        errors: list[BaseException] = []

        def other():
            try:
                with off:
                    pass
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert len(errors) == 1 and isinstance(errors[0], UnsupportedError)
    with pytest.raises(UnsupportedError):
        with off:
            pass


def test_two_threads_each_with_a_context_of_its_own(scratch):
    models = [mlp(), mlp()]
    xs = [torch.randn(512, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    plain = [step_and_grads(m, x)[0] for m, x in zip(models, xs)]
    results: dict[int, object] = {}

    def run(i):
        try:
            for _ in range(3):
                results[i] = step_and_grads(models[i], xs[i], scratch)
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert isinstance(results[i], tuple), results[i]
        assert same(plain[i], results[i][0])
        assert results[i][1].stats()["written"] > 0


def test_a_graph_built_in_a_context_back_propagated_on_another_thread(scratch):
    model, x = mlp(), torch.randn(512, 256)
    plain, _ = step_and_grads(model, x)
    with offload_activations(str(scratch), min_bytes=0, config=config()):
        loss = model(x).sum()
        thread = threading.Thread(target=loss.backward)
        thread.start()
        thread.join()
    assert same(plain, grads(model))


def test_tmpfs_folder_warns(small_fs):
    """tmpfs refuses O_DIRECT: the documented fallback is buffered IO (the bytes stay in memory), with a warning."""
    folder = small_fs(64 * MiB, "tmpfs")
    model, x = mlp(), torch.randn(256, 256)
    plain, _ = step_and_grads(model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offloaded, off = step_and_grads(model, x, folder)
    assert same(plain, offloaded)
    assert off.stats()["written"] > 0 and off.stats()["read"] > 0, off.stats()
    assert any("tmpfs" in str(w.message) for w in caught)


def test_a_folder_without_o_direct_falls_back_to_buffered_io(small_fs):
    """ramfs refuses O_DIRECT at any kernel: the op opens the file buffered instead; same gradients."""
    folder = small_fs(64 * MiB, "ramfs")
    model, x = mlp(), torch.randn(256, 256)
    plain, _ = step_and_grads(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (memory-backed folders warn: the bytes stay in memory)
        offloaded, off = step_and_grads(model, x, folder)
    assert same(plain, offloaded)
    assert off.stats()["written"] > 0 and off.stats()["read"] > 0, off.stats()


def test_exception_in_the_block_is_not_masked_and_files_go(scratch):
    model, x = mlp(), torch.randn(512, 256)
    with pytest.raises(KeyError):
        with offload_activations(str(scratch), min_bytes=0, config=config()):
            loss = model(x).sum()
            raise KeyError("user's")
    del loss
    assert os.listdir(scratch) == []


def test_tensors_off_the_cpu_stay_where_they_are_with_one_warning(scratch):
    w = nn.Parameter(torch.randn(64, 64, device="meta"))
    with pytest.warns(UserWarning, match="stay in device memory") as caught:
        with offload_activations(str(scratch), min_bytes=0, config=config()) as off:
            (w * torch.randn(64, 64, device="meta")).exp().sum()
    assert off.stats()["written"] == 0 and off.stats()["kept"] >= 2
    assert len([w for w in caught if "device memory" in str(w.message)]) == 1
