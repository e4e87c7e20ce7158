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
    library, user = bounds.activation_bounds()  # (the "large" shape)
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


def test_the_stated_bound_grows_with_the_sequence_by_the_resident_part_only():
    """Both sequence lengths of ``train_activations`` hold their bound under a cgroup (tests/memory/test_bounds.py,
    shapes "small" and "large"); between them the saved bytes grow 4x, the bound by a fixed count of one layer's
    activation (the resident part: being written, read ahead, in use, and the user's live ones) only."""
    _, layers, _ = bounds.workloads.ACTIVATIONS
    short, long = (bounds.workloads.ACTIVATION_ROWS[s] for s in ("small", "large"))
    assert long >= 4 * short
    grown = sum(bounds.activation_bounds(long)) - sum(bounds.activation_bounds(short))
    one_layer = bounds.activation_bytes(long) - bounds.activation_bytes(short)
    assert grown <= 10 * one_layer  # 4 resident (library) + 6 of the user's, whatever the number of layers
    assert grown < (2 * layers * one_layer) / 6  # while the saved activations grow by 2 * layers of them
