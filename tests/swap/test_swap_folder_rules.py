"""Where swap files may go: a missing base folder is created but never its parents (a mistyped path is an error, not
a new tree on another disk), a memory-backed one (tmpfs) is warned about, and an allocation that cannot be made
names the setting behind it."""

from __future__ import annotations

import errno
import os
import re
import shutil
import warnings

import pytest
import torch

from deepoffload import SwapConfig, TensorSwapper
from deepoffload.swap import folders


def test_only_the_last_part_of_a_missing_folder_is_created(scratch):
    # SwapConfig(folder=...) created a missing folder with all its parents
    typo = scratch / "nvme0" / "swap"
    with pytest.raises(FileNotFoundError, match=f"its parent {scratch / 'nvme0'} does not exist") as info:
        TensorSwapper(SwapConfig(folder=str(typo), pin=False))
    assert info.value.errno == errno.ENOENT and not (scratch / "nvme0").exists()
    swapper = TensorSwapper(SwapConfig(folder=str(scratch / "swap"), pin=False))
    try:
        assert os.path.dirname(swapper.folder) == str(scratch / "swap")
    finally:
        swapper.close()
    (scratch / "file").write_text("")
    with pytest.raises(OSError, match="not a folder|Not a directory|File exists"):
        TensorSwapper(SwapConfig(folder=str(scratch / "file"), pin=False))


def test_a_memory_backed_folder_is_warned_about(scratch):
    # a folder on /dev/shm silently "offloaded" into memory
    if not os.path.isdir("/dev/shm") or folders.memory_backed("/dev/shm") is None:
        pytest.skip("no tmpfs at /dev/shm here")
    base = f"/dev/shm/deepoffload-test-{os.getpid()}"
    try:
        with pytest.warns(UserWarning, match=f"swap folder {base} is on tmpfs, which keeps files in memory"):
            TensorSwapper(SwapConfig(folder=base, pin=False)).close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TensorSwapper(SwapConfig(folder=str(scratch), pin=False)).close()  # a disk: no warning


def test_a_staging_buffer_too_large_to_allocate_names_chunk_bytes(scratch):
    # a bare "[Errno 12] Cannot allocate memory" named no setting
    swapper = TensorSwapper(SwapConfig(folder=str(scratch), chunk_bytes=2**50, pin=False))
    try:
        with pytest.raises(OSError, match="1125899906842624-byte swap staging buffer .*chunk_bytes") as info:
            swapper.swap_out({"g": {"a": torch.ones(10)}}).wait()
        assert info.value.errno == errno.ENOMEM
    finally:
        swapper.close()


def test_a_folder_that_cannot_be_made_names_the_argument_each_entry_point_takes(scratch):
    """The advice names where each entry point takes its folder (a `folder=` keyword is refused by
    offload_parameters and passed on to the optimizer class by OffloadedOptimizer); following it works."""
    from torch import nn

    from deepoffload import OffloadedOptimizer, offload_parameters

    (scratch / "a-file").write_bytes(b"")
    bad, good = str(scratch / "a-file" / "swap"), str(scratch / "good")

    def make_offload(**where):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        return offload_parameters(model, **where)

    def make_optimizer(**where):
        return OffloadedOptimizer(torch.optim.Adam, nn.Linear(4, 4).parameters(), **where)

    calls = {
        "offload_parameters": (make_offload, "path=", lambda folder: {"path": folder}),
        "OffloadedOptimizer": (make_optimizer, "SwapConfig(folder=...)", lambda f: {"config": SwapConfig(folder=f)}),
    }
    for name, (make, argument, where) in calls.items():
        with pytest.raises(OSError) as refused:
            make(**where(bad))
        assert refused.value.errno == errno.ENOTDIR
        message = str(refused.value)
        assert re.search(rf"{re.escape(argument)}[^;]* {name}", message), message  # its own way is named
        make(**where(good)).close()
        with pytest.raises(TypeError):  # the keyword the message used to name
            make(folder=good)


def test_a_staging_buffer_refusal_names_what_each_entry_point_can_lower(scratch, monkeypatch):
    """offload_parameters sizes its staging buffers from its blocks (SwapConfig.chunk_bytes does not change them):
    the message names smaller blocks for it and chunk_bytes for OffloadedOptimizer; each, followed, fits."""
    from torch import nn

    from deepoffload import OffloadedOptimizer, offload_parameters
    from deepoffload.swap import pool

    real = pool.aligned_empty

    def limited(nbytes, *args, **kwargs):  # memory that holds buffers of 3 MiB, no larger
        if nbytes > 3 << 20:
            raise MemoryError("simulated")
        return real(nbytes, *args, **kwargs)

    monkeypatch.setattr(pool, "aligned_empty", limited)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(*(nn.Linear(512, 512) for _ in range(3))) for _ in range(2)))
    x = torch.randn(2, 512)
    with torch.no_grad():
        expected = model(x)
    with pytest.raises(OSError, match=r"stream smaller blocks \(offload_parameters\(blocks=\.\.\.\)\)") as refused:
        offload_parameters(model, str(scratch))
    assert refused.value.errno == errno.ENOMEM
    with pytest.raises(OSError):  # what the message advised before: chunk_bytes, which offload_parameters sizes
        offload_parameters(model, str(scratch), config=SwapConfig(chunk_bytes=1 << 20))
    with offload_parameters(model, str(scratch), blocks=[linear for block in model for linear in block]):
        with torch.no_grad():
            assert torch.equal(model(x), expected)

    def step(config):
        opt = OffloadedOptimizer(torch.optim.Adam, model.parameters(), config=config)
        try:
            model(x).sum().backward()
            opt.step()
        finally:
            opt.close()

    with pytest.raises(OSError, match=r"lower SwapConfig\(chunk_bytes=, buffer_count=\) \(OffloadedOptimizer"):
        step(SwapConfig(folder=str(scratch)))
    step(SwapConfig(folder=str(scratch), chunk_bytes=5 << 19))  # (no less than the largest state: 2 MiB)
