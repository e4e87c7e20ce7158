"""A write that fails, blocking or not, leaves no new file at its target (a full disk left a 0-byte file, though no
short file is promised); an existing file stays (its unwritten part as it was)."""

from __future__ import annotations

import errno

import pytest
import torch

from deepoffload import AsyncIOHandle

BIG = 4 << 20  # bytes: more than the 1 MiB filesystem holds


@pytest.fixture
def full_fs(small_fs):
    """A 1 MiB tmpfs holding a 100-byte file ``old``, and a tensor too large for it."""
    folder = small_fs(1 << 20, "tmpfs")
    (folder / "old").write_bytes(b"x" * 100)
    return folder, torch.ones(BIG, dtype=torch.uint8)


@pytest.mark.root
def test_a_full_disk_leaves_no_new_file(full_fs):
    folder, big = full_fs
    with AsyncIOHandle() as handle:
        with pytest.raises(OSError) as info:
            handle.write(big, folder / "new")
        assert info.value.errno == errno.ENOSPC
        assert not (folder / "new").exists()
        with pytest.raises(OSError):
            handle.write(big, folder / "old", truncate=False)
    assert (folder / "old").exists()


@pytest.mark.root
def test_a_failed_asynchronous_write_leaves_no_new_file(full_fs):
    folder, big = full_fs
    with AsyncIOHandle() as handle:
        new, old = handle.write_async(big, folder / "new"), handle.write_async(big, str(folder / "old"), truncate=False)
        for request in (new, old):
            with pytest.raises(OSError) as info:
                request.wait()
            assert info.value.errno == errno.ENOSPC
        assert not (folder / "new").exists()  # removed before wait() raised
        assert (folder / "old").read_bytes()[:100] == b"x" * 100  # it existed: kept
        # a write that succeeds to a new path keeps its file
        assert handle.write_async(torch.ones(16, dtype=torch.uint8), folder / "small").wait() == 16
    assert (folder / "small").read_bytes() == b"\x01" * 16
