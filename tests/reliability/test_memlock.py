"""RLIMIT_MEMLOCK too small for pinned buffers: a warning (once) and the unpinned path, with correct bytes, in the
handle, the DeepSpeed-compatible surface and the tensor swapper. Root bypasses the limit through CAP_IPC_LOCK, so
the child drops that capability (setpriv) before lowering the limit."""

from __future__ import annotations

import json
import os
import shutil

import pytest

CHILD = """
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
import torch
from deepoffload import AsyncIOHandle, aligned_empty, is_pinned
from deepoffload.op_builder import AsyncIOBuilder
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.tensor_swapper import TensorSwapper

folder = sys.argv[1]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    buffers = [aligned_empty(8 << 20) for _ in range(3)]  # 8 MiB each, far over 64 KiB
    data = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    with AsyncIOHandle() as h:
        buffers[0].copy_(data)
        h.write(buffers[0], folder + "/a")
        h.read(buffers[1], folder + "/a")
        assert torch.equal(buffers[1], data)
    ds = AsyncIOBuilder().load().aio_handle(1 << 20, 8, False, True, 2)
    locked = ds.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.float32))
    locked.copy_(torch.arange(1 << 20, dtype=torch.float32))
    assert ds.sync_pwrite(locked, folder + "/b") == 1
    back = torch.empty_like(locked)
    assert ds.sync_pread(back, folder + "/b") == 1 and torch.equal(back, locked)
    with TensorSwapper(SwapConfig(folder=folder, chunk_bytes=4 << 20, pin=True)) as swapper:
        state = {"m": torch.randn(1000, 1000), "v": torch.randn(333)}
        swapper.swap_out({"p": state}).wait()
        read = swapper.swap_in(["p"])
        restored = read.wait()["p"]
        assert all(torch.equal(restored[k], state[k]) for k in state)
        read.release()
memlock = [w for w in caught if "page-lock" in str(w.message)]
print("PINNED", any(is_pinned(b) for b in buffers))
print("WARNINGS", len(memlock))
print("MESSAGE", memlock[0].message if memlock else "")
"""


def drop_ipc_lock() -> tuple[str, ...]:
    """The command prefix that runs a child without CAP_IPC_LOCK (empty when not root: the limit applies)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root bypasses RLIMIT_MEMLOCK and util-linux setpriv (to drop CAP_IPC_LOCK) is missing")
    return (setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--")


def test_memlock_too_small_warns_once_and_uses_unpinned_buffers(scratch, run_python):
    proc = run_python(CHILD, prefix=drop_ipc_lock(), args=(str(scratch),))
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["PINNED"] == "False", "the pages were locked anyway: the limit (or the capability drop) failed"
    assert lines["WARNINGS"] == "1", "one warning, not one per buffer"
    assert "RLIMIT_MEMLOCK" in lines["MESSAGE"] and "ulimit -l" in lines["MESSAGE"], lines["MESSAGE"]


ENTRY_POINTS = """
import json, resource, sys, warnings
resource.setrlimit(resource.RLIMIT_MEMLOCK, (int(sys.argv[2]), int(sys.argv[2])))
import torch
from torch import nn
from deepoffload.io.buffers import _locked
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer
from deepoffload.swap.params import offload_parameters
from deepoffload import TrainOptions

folder = sys.argv[1]


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 256), *(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)),
                         nn.Linear(256, 2))


def train(net, step, zero):
    losses = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        loss = net(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        step()
        zero()
        losses.append(loss.item())
    return losses


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    streamed = model()
    adam = TrainOptions(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    off = offload_parameters(streamed, folder + "/params", train=adam)
    losses = train(streamed, off.step, off.zero_grad)
    locked = sum(_locked.values())
    off.close()
    plain = model()
    opt = OffloadedOptimizer(torch.optim.Adam, plain.parameters(), config=SwapConfig(folder=folder + "/opt"), lr=1e-2)
    opt_losses = train(plain, opt.step, opt.zero_grad)
    locked = max(locked, sum(_locked.values()))
    opt.close()
reference = model()
adam = torch.optim.Adam(reference.parameters(), lr=1e-2)
expected = train(reference, adam.step, adam.zero_grad)
memlock = [str(w.message) for w in caught if "page-lock" in str(w.message)]
print(json.dumps({"same": losses == expected and opt_losses == expected, "locked": locked, "warnings": memlock,
                  "weights": all(torch.equal(a, b) for a, b in zip(streamed.parameters(), reference.parameters()))}))
"""


@pytest.mark.parametrize("limit", [pytest.param(8 << 20, marks=pytest.mark.slow), 64 << 10])
def test_entry_points_train_on_unlocked_buffers_below_the_memlock_limit(scratch, run_python, limit):
    """Training with offload_parameters and OffloadedOptimizer under a container's usual RLIMIT_MEMLOCK (8 MiB,
    64 KiB; their staging pools want more): one warning naming the limit and how to raise it, no failure, and the
    same losses and weights as in memory."""
    proc = run_python(ENTRY_POINTS, prefix=drop_ipc_lock(), args=(str(scratch), str(limit)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["same"] and found["weights"], found
    assert found["locked"] <= limit, "locked beyond the limit: the limit (or the capability drop) failed"
    assert len(found["warnings"]) == 1, found["warnings"]
    assert "RLIMIT_MEMLOCK" in found["warnings"][0] and "ulimit -l" in found["warnings"][0]
