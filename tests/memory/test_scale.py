"""A model whose parameters are 8x the memory limit (parameters, gradients and Adam's two states: 32x) is built on
meta, loaded from its checkpoint, trained and generates inside a memory cgroup of that limit, with
``max_memory=`` set to it, and gives the same losses and tokens as the same run without the limit.

The limit cannot be small: the process after its imports alone takes about 215 MiB of it. At 384 MiB the model has
3 GiB of parameters (a 3.2 GB checkpoint) and each run moves about 25 GB through storage (load, two Adam steps, two
tokens), twice; measured on the development machine: 42 s for the confined run (peak 355 MiB), 100 s for the test.
It is slow-marked and needs a memory cgroup (root):

    PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider tests/memory/test_scale.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .bounds import _env, build_op, memlimit

MiB = 1 << 20
LIMIT = 384 * MiB  # the process after its imports takes about 215 MiB of it (torch, and torch._dynamo)
WIDTH, DEPTH = 1024, 384  # two 4 MiB weights per block: 3 GiB of parameters, 8x the limit

MODEL = f"""
import json, sys
import torch
from torch import nn

WIDTH, DEPTH, VOCAB = {WIDTH}, {DEPTH}, 64


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh(),
                                                  nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh())
                                    for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def tensors():
    with torch.device("meta"):
        shapes = {{n: t.shape for n, t in LM().state_dict().items()}}
    for i, (name, shape) in enumerate(shapes.items()):
        yield name, torch.randn(shape, generator=torch.Generator().manual_seed(i)) / shape[-1] ** 0.5
"""

PREPARE = (
    MODEL
    + """
from deepoffload.formats import save_sharded
save_sharded(tensors(), sys.argv[1], max_shard_bytes=512 << 20)
"""
)

RUN = (
    MODEL
    + """
from deepoffload import LoadOptions, StreamOptions, TrainOptions
from deepoffload.swap.params import offload_parameters

with torch.device("meta"):
    model = LM()
off = offload_parameters(model, sys.argv[2], train=TrainOptions(lambda ps: torch.optim.Adam(ps, lr=1e-3)),
                         load=LoadOptions(checkpoint=sys.argv[1]), stream=StreamOptions(max_memory=int(sys.argv[3])))
losses = []
for step in range(2):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=g)
    loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    off.step()
    off.zero_grad()
    losses.append(loss.item())
tokens = [1, 2, 3]
with torch.no_grad():
    for _ in range(2):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
print(json.dumps({"losses": losses, "tokens": tokens, "prefetch": off.plan.prefetch,
                  "resident": off.plan.resident_bytes}))
off.close(restore=False)
"""
)

reason = memlimit.unavailable()


@pytest.mark.slow
@pytest.mark.skipif(reason is not None, reason=reason or "")
def test_model_8x_the_limit_trains_and_generates_inside_it(scratch):
    param_bytes = (64 * WIDTH + DEPTH * 2 * WIDTH * WIDTH + WIDTH * 64 + 64) * 4
    assert param_bytes >= 8 * LIMIT
    env = _env()
    build_op()  # unconfined: the compiler must not run inside the limit
    subprocess.run([sys.executable, "-c", PREPARE, str(scratch / "ckpt")], check=True, env=env, timeout=1800)
    argv = [sys.executable, "-c", RUN, str(scratch / "ckpt"), str(scratch / "swap"), str(LIMIT)]
    limited = memlimit.run_limited(argv, LIMIT, env=env, timeout=3600)
    assert limited.returncode == 0 and limited.oom_kills == 0, limited
    assert limited.peak_bytes is None or limited.peak_bytes <= LIMIT
    free = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
    assert free.returncode == 0, free.stderr[-3000:]
    inside, outside = json.loads(limited.stdout.splitlines()[-1]), json.loads(free.stdout.splitlines()[-1])
    assert inside["losses"] == outside["losses"] and inside["tokens"] == outside["tokens"], (inside, outside)
    assert len(set(inside["losses"])) == 2  # the step changed the model
