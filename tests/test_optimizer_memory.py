"""Memory: an offloaded optimizer's state really leaves RAM, and the peak RSS of offloaded steps is bounded by the
pipeline's buffers (chunk_bytes x buffers), not by the total state. Measured in fresh processes (VmHWM)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PARAMS, NUMEL = 48, 1 << 20  # 48 fp32 parameters of 4 MiB: 400 MB of Adam moments
CHUNK = 8 << 20


def child(mode: str, folder: str) -> None:
    import torch

    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(PARAMS)]
    for p in params:
        p.grad = torch.randn(NUMEL)

    def rss(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    if mode == "offloaded":
        optimizer = OffloadedOptimizer(torch.optim.Adam, params, SwapConfig(folder=folder, chunk_bytes=CHUNK,
                                                                              buffer_count=3), lr=1e-3)
    else:
        optimizer = torch.optim.Adam(params, lr=1e-3)
    baseline = rss("VmRSS:")  # params, grads, and for offloading the loaded native op: no state yet
    for _ in range(3):
        optimizer.step()
    stored = optimizer.stored_bytes() if mode == "offloaded" else 0
    print(json.dumps({"baseline": baseline, "after": rss("VmRSS:"), "peak": rss("VmHWM:"), "stored": stored}))


def measure(mode: str, folder) -> dict:
    out = subprocess.run([sys.executable, __file__, mode, str(folder)], capture_output=True, text=True, check=True,
                         timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_rss_is_bounded_by_buffers_not_state(scratch):
    state = 2 * PARAMS * NUMEL * 4
    memory, offloaded = measure("in-memory", scratch), measure("offloaded", scratch)
    assert offloaded["stored"] >= state
    assert memory["after"] - memory["baseline"] > 0.9 * state  # the reference really holds its state
    # offloaded: between steps the pooled buffers stay (3 x 8 MiB), plus heap the allocator keeps from the first
    # step's state (made by torch, copied out, freed); at peak a few chunks are in flight, never the whole state
    assert offloaded["after"] - offloaded["baseline"] < 3 * CHUNK + 0.25 * state
    assert offloaded["peak"] - offloaded["baseline"] < 0.4 * state
    assert offloaded["peak"] < memory["peak"] - 0.5 * state


if __name__ == "__main__":
    child(*sys.argv[1:])
