"""Memory: a step whose saved activations are three times what ``train_activations`` may hold above its imports runs
within its stated bound (tests/memory/bounds.py) in a memory cgroup, where the same step without
``offload_activations`` is killed; and the peak shrinks by at least 3/4 of the saved activations' bytes."""

from __future__ import annotations

import pytest

from tests.memory import bounds
from tests.memory.bounds import memlimit

reason = memlimit.unavailable()
pytestmark = [pytest.mark.skipif(reason is not None, reason=reason or ""), pytest.mark.slow]
MiB = 1 << 20


def test_saved_activations_leave_memory(tmp_path):
    bounds.build_op()
    base = bounds.baseline(tmp_path)
    library, user = bounds.activation_bounds()
    _, layers, _ = bounds.workloads.ACTIVATIONS
    saved = 2 * layers * bounds.activation_bytes()  # each layer saves its Linear's input and its GELU's input
    assert saved >= 3 * (library + user), "the step's saved activations are several times what it may hold"
    bound = base + library + user
    offloaded = bounds.child("train_activations", "large", tmp_path, bound + bound // 10)
    assert offloaded.returncode == 0 and offloaded.oom_kills == 0, offloaded
    assert offloaded.peak_bytes is not None and offloaded.peak_bytes <= bound, (offloaded.peak_bytes, bound)
    plain = bounds.child("train_activations_plain", "large", tmp_path, bound + bound // 10)
    assert plain.returncode != 0 or plain.oom_kills > 0, "without offload_activations the step does not fit"
    free = bounds.child("train_activations_plain", "large", tmp_path, bound + 2 * saved)
    assert free.returncode == 0 and free.peak_bytes is not None, free
    assert free.peak_bytes - offloaded.peak_bytes >= 0.75 * saved, (
        f"peak {offloaded.peak_bytes / MiB:.0f} MiB offloaded, {free.peak_bytes / MiB:.0f} MiB in memory, "
        f"saved activations {saved / MiB:.0f} MiB"
    )
    assert bounds.json.loads(offloaded.stdout.splitlines()[-1]) == bounds.json.loads(free.stdout.splitlines()[-1]), (
        "the same gradients"
    )
