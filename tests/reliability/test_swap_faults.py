"""Faults around optimizer-state swapping: the disk filling up in the middle of a swap-out, and a training process
killed in the middle of a step that a new process resumes from its last checkpoint. Results are compared bit for
bit with plain in-memory Adam. (A byte flipped in a swap file with checksums on is tested in
tests/test_swap_tensor.py; the parameter write-back under a full disk in tests/test_params_errors.py.)"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer

from .conftest import fill

MiB = 1 << 20
SHAPE = (256, 1024)  # 1 MiB of float32 per parameter; Adam keeps 2 MiB of state for each


def make_params(count: int = 6) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(SHAPE, generator=gen)) for _ in range(count)]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i]) for i in a
    )


@pytest.mark.parametrize("kind", ["ext4", "tmpfs"])
def test_disk_full_during_swap_out_loses_nothing_and_the_run_continues_identically(aio, small_fs, kind):
    folder = small_fs(32 * MiB, kind)
    reference, params = make_params(), make_params()
    plain = torch.optim.Adam(reference, lr=1e-2)
    config = SwapConfig(folder=str(folder), chunk_bytes=2 * MiB + 8192, buffer_count=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "deepoffload: the filesystem .* refuses O_DIRECT", RuntimeWarning)
        offloaded = OffloadedOptimizer(torch.optim.Adam, params, config=config, lr=1e-2)
        filler = fill(folder, leave_bytes=5 * MiB)  # room for about two parameters' state, of six
        set_grads(reference, 1), set_grads(params, 1)
        plain.step()
        with pytest.raises(OSError) as info:
            offloaded.step()
        assert info.value.errno == errno.ENOSPC, info.value
        assert "write" in str(info.value) and ".swp" in str(info.value), "the message names the operation and file"
        assert all(torch.equal(a, b) for a, b in zip(params, reference)), "every parameter took its step"
        resident = [p for p in params if "exp_avg" in offloaded.state.get(p, {})]
        stored = [p for p in params if offloaded.swapper.records(offloaded.pipeline.name(p))]
        assert resident and stored and len(resident) + len(stored) == len(params), (
            "each parameter's state is either safely on storage or still in memory"
        )
        assert same_state(offloaded.state_dict()["state"], plain.state_dict()["state"]), (
            "the state on storage and in memory is exactly the step's"
        )
        os.unlink(filler)  # space freed: the same optimizer carries on
        for step in (2, 3):
            set_grads(reference, step), set_grads(params, step)
            plain.step()
            offloaded.step()
        assert all(torch.equal(a, b) for a, b in zip(params, reference)), "identical to a run that never failed"
        assert not any("exp_avg" in offloaded.state.get(p, {}) for p in params), "the resident state went out"
        assert same_state(offloaded.state_dict()["state"], plain.state_dict()["state"])
        offloaded.close()


TRAIN = """
import os, sys, torch
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer
from tests.reliability.test_swap_faults import make_params, set_grads
folder, checkpoint, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
gated = sys.argv[4:] == ["gated"]  # after steps 2 and 4, wait for a line on stdin (the killer's cue, then never)
params = make_params()
opt = OffloadedOptimizer(torch.optim.Adam, params, config=SwapConfig(folder=folder, chunk_bytes=2 << 20), lr=1e-2)
first = 1
if os.path.exists(checkpoint):
    saved = torch.load(checkpoint)
    with torch.no_grad():
        for p, value in zip(params, saved["params"]):
            p.copy_(value)
    opt.load_state_dict(saved["optimizer"])
    first = saved["step"] + 1
    print("RESUMED", saved["step"], flush=True)
for step in range(first, last + 1):
    set_grads(params, step)
    opt.step()
    torch.save({"params": [p.detach() for p in params], "optimizer": opt.state_dict(), "step": step},
               checkpoint + ".tmp")
    os.replace(checkpoint + ".tmp", checkpoint)  # a kill never leaves a half-written checkpoint in its place
    print("STEP", step, flush=True)
    if gated and step in (2, 4):
        sys.stdin.readline()
torch.save([p.detach() for p in params], folder + "/final.pt")
"""


def test_killed_mid_step_resumes_from_the_last_checkpoint_identically(aio, scratch):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    checkpoint, last = str(scratch / "ckpt.pt"), 6
    command = [sys.executable, "-c", TRAIN, str(scratch), checkpoint, str(last)]
    # The victim stops after step 2 until told to go on, and again after step 4 for good: the kill that follows
    # the cue lands in step 3 or 4 (reading, stepping or writing optimizer state, or saving the checkpoint), or at
    # the second stop; never after the run (a kill sent on reading "STEP 2" alone could arrive after it had finished
    # under load).
    victim = subprocess.Popen(
        command + ["gated"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in victim.stdout:
        if line.startswith("STEP 2"):
            victim.stdin.write("go\n")
            victim.stdin.flush()
            victim.send_signal(signal.SIGKILL)
            break
    victim.wait(timeout=120)
    assert victim.returncode == -signal.SIGKILL, victim.stderr.read()
    resumed = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert any(f"RESUMED {k}" in resumed.stdout for k in (2, 3, 4)), resumed.stdout
    reference = make_params()
    plain = torch.optim.Adam(reference, lr=1e-2)
    for step in range(1, last + 1):
        set_grads(reference, step)
        plain.step()
    final = torch.load(scratch / "final.pt")
    assert all(torch.equal(a, b) for a, b in zip(final, reference)), "the resumed run equals an uninterrupted one"
