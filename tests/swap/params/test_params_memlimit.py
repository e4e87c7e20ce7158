"""The proof that a model larger than memory can be built, loaded, trained and saved with deepoffload alone: a
child process confined by a memory cgroup smaller than the model's parameters builds it on the meta device, loads
it from a safetensors checkpoint larger than the limit, trains a few steps with the optimizer state offloaded, and
saves it; its losses and saved weights equal those of the same model trained in memory by this (unconfined)
process."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.support import memlimit

MiB = 1 << 20
reason = memlimit.unavailable()
# glibc otherwise raises its mmap threshold after large frees and keeps freed block-sized buffers in its heap
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2"}

MODEL = """
import torch
from torch import nn

WIDTH, DEPTH, STEPS = 1024, 84, 3


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, WIDTH)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, 8)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)
"""

CHILD = (
    MODEL
    + """
import json, sys
from deepoffload import LoadOptions, TrainOptions
from deepoffload.swap.params import offload_parameters

checkpoint, swap, saved = sys.argv[1:4]
with torch.device("meta"):
    model = Tower()
off = offload_parameters(model, swap, train=TrainOptions(adam), load=LoadOptions(checkpoint=checkpoint))
losses = []
for step in range(STEPS):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    off.step()
    off.zero_grad()
    losses.append(loss.item())
off.save(saved, max_shard_bytes=64 << 20)
off.close(restore=False)
print(json.dumps(losses))
"""
)


@pytest.mark.slow
@pytest.mark.skipif(reason is not None, reason=reason or "")
def test_larger_than_memory_model_loads_trains_and_saves_inside_the_limit(scratch):
    from safetensors.torch import save_file

    from deepoffload.formats import CheckpointReader

    space: dict = {}
    exec(MODEL, space)
    limit = 320 * MiB  # importing torch alone takes about 150 MiB of it
    torch.manual_seed(0)
    model = space["Tower"]()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert param_bytes > limit and 4 * param_bytes >= 4 * limit  # params + grads + Adam's two states: >= 4x
    save_file(model.state_dict(), str(scratch / "model.safetensors"))
    assert (scratch / "model.safetensors").stat().st_size > limit

    run = memlimit.run_limited(
        [
            sys.executable,
            "-c",
            CHILD,
            str(scratch / "model.safetensors"),
            str(scratch / "swap"),
            str(scratch / "saved"),
        ],
        limit,
        timeout=300,
        env={**os.environ, **MALLOC_ENV},
    )
    assert run.returncode == 0 and run.oom_kills == 0, run
    assert run.peak_bytes is None or run.peak_bytes <= limit

    optimizer = space["adam"](model.parameters())
    losses = []
    for step in range(space["STEPS"]):
        x, y = space["batch"](step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert json.loads(run.stdout) == losses
    assert len(set(losses)) == len(losses)  # the steps changed the model
    expected = model.state_dict()
    with CheckpointReader(scratch / "saved") as reader:
        assert sorted(reader.names()) == sorted(expected)
        for name, tensor in reader.iter_tensors():
            assert torch.equal(tensor, expected[name]), name
