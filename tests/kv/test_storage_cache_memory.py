"""Memory: greedy generation after a 4096-token prompt (chunked prefill) with a ``StorageCache`` of 2 resident
layers runs within its stated bound (tests/memory/bounds.py ``kv_cache_bounds``: the resident layers plus parts that
do not grow with the sequence) in a memory cgroup, where the same generation with a ``DynamicCache`` is killed; the
peak shrinks by at least 3/4 of the KV cache's bytes; the tokens are the same."""

from __future__ import annotations

import os

import pytest

from tests.memory import bounds
from tests.memory.bounds import memlimit

reason = memlimit.unavailable()
pytestmark = [
    pytest.mark.skipif(reason is not None, reason=reason or ""),
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("DEEPOFFLOAD_TEST_LARGE_MEMORY") != "1", reason="minutes long: DEEPOFFLOAD_TEST_LARGE_MEMORY=1"
    ),
]
MiB = 1 << 20


def test_the_kv_cache_leaves_memory(tmp_path):
    bounds.build_op()
    base = bounds.baseline(tmp_path, "imports_hf")
    library, user = bounds.kv_cache_bounds()
    layers = bounds.workloads.KV_CACHE[0]
    kv = layers * bounds.kv_layer_bytes()
    assert kv >= 2 * library, "the KV cache is several times what the cache may hold"
    bound = base + library + user
    stored = bounds.child("generate_storage_cache", "large", tmp_path, bound + bound // 10)
    assert stored.returncode == 0 and stored.oom_kills == 0, stored
    assert stored.peak_bytes is not None and stored.peak_bytes <= bound, (stored.peak_bytes, bound)
    dynamic = bounds.child("generate_dynamic_cache", "large", tmp_path, bound + bound // 10)
    assert dynamic.returncode != 0 or dynamic.oom_kills > 0, "with a DynamicCache the generation does not fit"
    free = bounds.child("generate_dynamic_cache", "large", tmp_path, bound + 2 * kv)
    assert free.returncode == 0 and free.peak_bytes is not None, free
    assert free.peak_bytes - stored.peak_bytes >= 0.75 * kv, (
        f"peak {stored.peak_bytes / MiB:.0f} MiB on storage, {free.peak_bytes / MiB:.0f} MiB in memory, "
        f"KV cache {kv / MiB:.0f} MiB"
    )
    assert bounds.json.loads(stored.stdout.splitlines()[-1]) == bounds.json.loads(free.stdout.splitlines()[-1])
