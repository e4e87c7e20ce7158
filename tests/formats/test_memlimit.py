"""The memory-cgroup helper (tests/support/memlimit.py) confines a child, and a checkpoint larger than the limit loads
through deepoffload.formats tensor by tensor inside it."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.support import memlimit

MiB = 1 << 20
reason = memlimit.unavailable()
needs_cgroup = pytest.mark.skipif(reason is not None, reason=reason or "")

TOUCH = "b = bytearray({n}); b[::4096] = b'\\x01' * len(range(0, len(b), 4096)); print('survived')"


@needs_cgroup
def own_groups() -> set[str]:
    """This process's test groups (another pytest worker's run beside it)."""
    mine = f"deepoffload-test-{os.getpid()}-"
    return {name for name in os.listdir(memlimit.MemoryCgroup(1).path.parent) if name.startswith(mine)}


def test_limit_confines_a_child_and_the_group_is_removed():
    groups_before = own_groups()
    over = memlimit.run_limited([sys.executable, "-c", TOUCH.format(n=1 << 30)], 256 * MiB)
    assert "survived" not in over.stdout
    assert over.returncode == -9 and over.oom_kills >= 1 or "MemoryError" in over.stderr, over
    under = memlimit.run_limited([sys.executable, "-c", TOUCH.format(n=64 * MiB)], 256 * MiB)
    assert under.returncode == 0 and under.stdout.strip() == "survived", under
    assert under.oom_kills == 0
    assert under.peak_bytes is None or 64 * MiB <= under.peak_bytes <= 256 * MiB
    assert own_groups() == groups_before


CHILD = """
import json, sys, torch
from deepoffload.formats import CheckpointReader
sums = {}
with CheckpointReader(sys.argv[1], span_bytes=16 << 20, inflight_bytes=32 << 20) as reader:
    for name, tensor in reader.iter_tensors():
        sums[name] = int(tensor.view(torch.int32).sum(dtype=torch.int64))
print(json.dumps(sums))
"""


def checksum(t: torch.Tensor) -> int:
    return int(t.view(torch.int32).sum(dtype=torch.int64))


@pytest.mark.slow
@needs_cgroup
def test_checkpoint_larger_than_the_limit_loads_inside_it(scratch, aio):
    from deepoffload.formats import save_sharded

    limit, count, numel = 320 * MiB, 48, 4 * MiB  # 48 tensors of 16 MiB: 768 MiB, 2.4x the limit
    sums = {}

    def tensors():  # generated one at a time, so the parent never holds the checkpoint either
        for i in range(count):
            t = torch.randint(
                -(2**31), 2**31 - 1, (numel,), dtype=torch.int32, generator=torch.Generator().manual_seed(i)
            ).view(torch.float32)
            sums[f"layers.{i}.weight"] = checksum(t)
            yield f"layers.{i}.weight", t

    save_sharded(tensors(), scratch, max_shard_bytes=200 * MiB)
    nbytes = count * numel * 4
    assert nbytes > 2 * limit
    run = memlimit.run_limited([sys.executable, "-c", CHILD, str(scratch)], limit, env=dict(os.environ))
    assert run.returncode == 0, run
    assert json.loads(run.stdout) == sums
    assert run.oom_kills == 0
    assert run.peak_bytes is None or run.peak_bytes <= limit
