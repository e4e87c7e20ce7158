"""``close()`` releases every descriptor a handle holds at once (an io_uring ring per worker thread), not when the
handle object is collected: a program that keeps closed handles referenced must not run out of descriptors."""

from __future__ import annotations

import os

import pytest
import torch

from deepoffload import AioConfig, AsyncIOHandle


def rings() -> int:
    """This process's open io_uring descriptors."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[io_uring]"
        except OSError:
            pass  # the listing's own descriptor, gone
    return count


def test_close_releases_the_io_uring_rings_at_once(scratch):
    # an io_uring handle's close() kept its rings until garbage collection (EMFILE under ulimit -n 64)
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    before = rings()
    try:
        handle = AsyncIOHandle(AioConfig(engine="io_uring", intra_op_parallelism=2))
    except (OSError, RuntimeError, ValueError) as e:
        pytest.skip(f"io_uring is not usable here: {e}")
    handle.write(torch.ones(4096, dtype=torch.uint8), scratch / "f.bin")
    assert rings() > before
    kept = [handle]  # still referenced after close: its rings must go anyway
    handle.close()
    assert rings() == before
    for _ in range(40):
        h = AsyncIOHandle(AioConfig(engine="io_uring"))
        h.close()
        kept.append(h)
    assert rings() == before
