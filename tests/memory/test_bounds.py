"""Every entry point holds its stated bound (tests/memory/bounds.py) in a child confined by a memory cgroup set to
that bound plus 10%, with glibc's default allocator: with tensors above glibc's mmap threshold (16 MiB weights) and
with many below it (64 KiB). A child killed by the limit, or a peak over the bound, fails."""

from __future__ import annotations

import pytest

from . import bounds
from .bounds import memlimit

reason = memlimit.unavailable()
pytestmark = pytest.mark.skipif(reason is not None, reason=reason or "")
CASES = [
    (entry, shape)
    for shape in ("large", "small")
    for entry in bounds.ENTRIES
    if not (entry in bounds.ONE_SHAPE and shape == "small")
]


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
