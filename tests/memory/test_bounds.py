"""Every entry point holds its stated bound (tests/memory/bounds.py) in a child confined by a memory cgroup set to
that bound plus 10%, with glibc's default allocator: with tensors above glibc's mmap threshold (16 MiB weights) and
with many below it (64 KiB). A child killed by the limit, or a peak over the bound, fails."""

from __future__ import annotations

import os

import pytest

from . import bounds
from .bounds import memlimit

reason = memlimit.unavailable()
pytestmark = pytest.mark.skipif(reason is not None, reason=reason or "")
CASES = [
    (entry, shape)
    for shape in ("large", "small")
    for entry in bounds.ENTRIES
    if not (entry in bounds.ONE_SHAPE and shape == "small") and entry not in bounds.LARGE
]
LARGE = pytest.mark.skipif(
    os.environ.get("DEEPOFFLOAD_TEST_LARGE_MEMORY") != "1", reason="minutes long: DEEPOFFLOAD_TEST_LARGE_MEMORY=1"
)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(entry, shape) -> (a folder holding the checkpoint it reads, the process after its imports)."""
    folders, bases = {}, {}
    bounds.build_op()

    def get(entry: str, shape: str):
        if shape not in folders:
            folders[shape] = tmp_path_factory.mktemp(f"memory-{shape}")
        bounds.prepare(shape, folders[shape], [bounds.needs(entry)])
        kind = bounds.imports(entry)
        if kind not in bases:
            bases[kind] = bounds.baseline(folders[shape], kind)
        return folders[shape], bases[kind]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("entry,shape", CASES)
def test_entry_point_holds_its_stated_bound(entry, shape, prepared):
    folder, base = prepared(entry, shape)
    measured, run = bounds.measure(entry, shape, folder, base)
    assert run.returncode == 0 and run.oom_kills == 0, (
        f"{entry} ({shape}) under {measured.bound * 1.1:.0f} bytes: {run}"
    )
    assert run.peak_bytes is not None and run.peak_bytes <= measured.bound, (
        f"{entry} ({shape}): peak {run.peak_bytes} bytes over its stated bound {measured.bound} ({measured})"
    )


def test_lora_over_a_served_base_states_a_bound_that_does_not_grow_with_the_base():
    """The bound is the process, the streaming plan of one block span, the adapters (values, gradients, Adam's two
    states) and the forward: a base of 4 times the blocks (the same adapters per block) adds only adapter bytes."""
    small, large = (bounds.workloads.sizes("lora_served", "large", layers) for layers in (50, 200))
    assert large["param_bytes"] > 3.9 * small["param_bytes"]
    (lib_small, user_small), (lib_large, user_large) = (bounds.stated("lora_served", s) for s in (small, large))
    assert user_small == user_large
    assert lib_large - lib_small == 4 * (large["adapter_bytes"] - small["adapter_bytes"])


@pytest.mark.slow
@LARGE
def test_lora_over_a_served_base_trains_in_a_quarter_of_the_base_with_the_unconfined_results(prepared):
    """LoRA over a 2.7 GB base served from its folder, confined to its bound + 10%, which is under a quarter of the
    base's bytes; losses, adapters and the swap folder's bytes equal the unconfined run's, the base never copied."""
    folder, base = prepared("lora_served", "large")
    sizes = bounds.workloads.sizes("lora_served", "large")
    measured, run = bounds.measure("lora_served", "large", folder, base, compare=True)
    assert measured.bound * 1.1 <= sizes["param_bytes"] / 4, (measured, sizes)
    assert run.returncode == 0 and run.oom_kills == 0, run
    assert run.peak_bytes is not None and run.peak_bytes <= measured.bound
    swap_bytes = measured.result[2]
    assert swap_bytes < sizes["param_bytes"] / 10
