"""Parameter offload, errors: storage full while offloading, during a fused write-back and while writing gradients
(OSError ENOSPC, the block's values kept in memory, written later by flush), a missing swap file (an error naming
the parameter), and bad arguments."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
from torch import nn

from deepoffload import StreamOptions, TrainOptions
from deepoffload.swap.params import Residency, offload_parameters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # O_DIRECT falls back on tmpfs, with a warning


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "fs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a tmpfs is not allowed here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(folder) -> str:
    """Take every free byte of ``folder``'s filesystem; returns the filler's path."""
    path = os.path.join(folder, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


def pair(width: int = 128, depth: int = 2) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    reference = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    model.load_state_dict(reference.state_dict())
    return reference, model


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def test_storage_full_while_offloading_leaves_the_module_unchanged(small_fs):
    reference, model = pair(width=256, depth=6)  # 6 x 257 KiB > 1 MiB
    with pytest.raises(OSError) as info:
        offload_parameters(model, str(small_fs))
    assert info.value.errno == errno.ENOSPC and "the module is unchanged" in str(info.value)
    assert all("forward" not in m.__dict__ for m in model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert os.listdir(small_fs) == []  # its run folder is gone


def test_storage_full_during_fused_write_back_keeps_the_block(small_fs):
    reference, model = pair()
    x = torch.randn(4, 128)
    optimizer = adam(reference.parameters())
    reference(x).square().mean().backward()
    optimizer.step()
    offload = offload_parameters(model, str(small_fs), train=TrainOptions(optimizer=adam))
    try:
        filler = fill(small_fs)
        with pytest.raises(OSError) as info:
            model(x).square().mean().backward()  # the last block steps first; its state cannot be written
        assert info.value.errno == errno.ENOSPC
        last = model[1]
        assert offload.blocks[1].state is Residency.KEPT  # still in memory, updated: the only valid copy
        assert torch.equal(last.weight, reference[1].weight) and torch.equal(last.bias, reference[1].bias)
        os.remove(filler)
        offload.flush()  # now written out and released
        assert offload.blocks[1].state is Residency.ON_STORAGE
        state = offload.state_dict()
        assert torch.equal(state["1.weight"], reference[1].weight)
        assert not torch.equal(state["0.weight"], reference[0].weight)  # backward stopped before block 0 stepped
    finally:
        offload.close()


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_storage_full_while_writing_gradients_keeps_them(small_fs, clip):
    """The gradients kept in memory are stepped (and counted in the global norm when clipping) exactly once."""
    reference, model = pair()
    x = torch.randn(4, 128)
    reference(x).square().mean().backward()
    offload = offload_parameters(model, str(small_fs), train=TrainOptions(mode="grads", optimizer=adam))
    try:
        filler = fill(small_fs)
        with pytest.raises(OSError) as info:
            model(x).square().mean().backward()
            offload.step()
        assert info.value.errno == errno.ENOSPC and "gradients of block 1" in str(info.value)
        assert offload.stats.grad_bytes >= 128 * 129 * 4  # block 1's gradients, kept in memory
        os.remove(filler)
        # steps from the gradients kept in memory (block 1) and in param.grad (block 0): none lost
        total = offload.step(clip_grad_norm=clip)
        offload.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    finally:
        offload.close(restore=True)
    if clip is not None:
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        assert torch.equal(total, expected) and expected.item() > clip
    torch.optim.Adam(reference.parameters(), lr=1e-2).step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_missing_swap_file_names_the_parameter(scratch):
    _, model = pair()
    offload = offload_parameters(model, str(scratch))
    try:
        path = os.path.join(offload.store.swapper.folder, "block1.swp")
        os.remove(path)
        with pytest.raises(FileNotFoundError) as info, torch.no_grad():
            model(torch.randn(2, 128))
        message = str(info.value)
        assert "parameter 1.weight" in message and "1.bias" in message and info.value.filename == path
        with pytest.raises(FileNotFoundError):
            offload.close()  # restoring cannot read block 1: said, not skipped
    finally:
        offload.close(restore=False)


def test_bad_arguments_are_clear_errors(scratch):
    _, model = pair()
    with pytest.raises(ValueError, match="mode 'sync'"):
        offload_parameters(model, str(scratch), train=TrainOptions(torch.optim.SGD, mode="sync"))
    with pytest.raises(ValueError, match="prefetch=-1"):
        offload_parameters(model, str(scratch), stream=StreamOptions(prefetch=-1))
    with pytest.raises(ValueError, match="compute_dtype"):
        offload_parameters(model, str(scratch), stream=StreamOptions(compute_dtype=torch.int8))
    with pytest.raises(ValueError, match="no blocks"):
        offload_parameters(nn.Linear(2, 2), str(scratch))
    with pytest.raises(ValueError, match="not a submodule"):
        offload_parameters(model, str(scratch), blocks=[nn.Linear(2, 2)])
    shared = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    shared[2].weight = shared[0].weight  # two blocks, one tensor (one module twice is one block: test_params_patterns)
    with pytest.raises(ValueError, match="same tensor as 0.weight in another block"):
        offload_parameters(shared, str(scratch))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied.head = nn.Linear(4, 4)
    tied.head.weight = tied[0].weight
    with pytest.raises(ValueError, match="outside the blocks"):
        offload_parameters(tied, str(scratch), blocks=[tied[0], tied[1]])
    offload = offload_parameters(model, str(scratch))
    out = model(torch.randn(2, 128))  # gradients enabled: the forward works (an eval call without no_grad)
    with pytest.raises(RuntimeError, match="no optimizer"):
        out.sum().backward()  # but the parameters need gradients and nothing steps them
    with pytest.raises(ValueError, match="no optimizer"):
        offload.step()
    offload.close(restore=False)
    with pytest.raises(RuntimeError, match="closed"):
        with torch.no_grad():
            model(torch.randn(2, 128))
