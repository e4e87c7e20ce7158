"""Several drives at once (``SwapConfig(folder=[a, b])``, the ``drives`` layout): records spread over every drive by
its share, one IO handle per drive, same-device folders counted once, a missing folder refused, a full drive named
with nothing lost, every drive's files removed at close and by the next run after a crash.

Drives are loop-device ext4 filesystems (tmpfs for the full one) made by ``tests/support/drives.py``: root only,
skipped with the reason elsewhere."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from deepoffload import OffloadedOptimizer, SwapConfig, TensorSwapper, offload_parameters
from deepoffload.errors import ConfigError
from tests.support.drives import Drives, unavailable

REPO = Path(__file__).resolve().parents[2]


def _drives(count: int, kind: str = "loop", size: int = 32 << 20):
    reason = unavailable(kind)
    if reason is not None:
        pytest.skip(reason)
    return Drives(count, size=size, kind=kind)


@pytest.fixture
def two():
    with _drives(2) as drives:
        yield drives.folders


def _run_folders(base: str) -> list[str]:
    return [n for n in os.listdir(base) if n.startswith("deepoffload-")]


def test_a_list_of_folders_selects_the_drives_layout_and_round_trips_the_json():
    config = SwapConfig(folder=["a", "b"], folder_speeds=[2, 1], pin=False)
    assert config.layout == "drives" and config.folder == ("a", "b") and config.folder_speeds == (2.0, 1.0)
    assert SwapConfig.from_dict(config.to_dict()) == config
    assert SwapConfig(folder=["a"]).folder == "a" and SwapConfig(folder=["a"]).layout == "folder"
    with pytest.raises(ConfigError, match="listed twice"):
        SwapConfig(folder=["a", "a"])
    with pytest.raises(ConfigError, match="one speed per folder"):
        SwapConfig(folder=["a", "b"], folder_speeds=[1.0])
    with pytest.raises(ConfigError, match="empty list"):
        SwapConfig(folder=[])


def test_groups_spread_over_every_drive_each_with_its_own_handle(two):
    written = {f"g{i}": {"w": torch.randn(1000 + i)} for i in range(8)}
    with TensorSwapper(SwapConfig(folder=two, pin=False)) as swapper:
        assert len(swapper.io.handles) == 2 and swapper.io.handles[0] is not swapper.io.handles[1]
        swapper.swap_out(written).wait()
        placed = [swapper.layout.drive(swapper.records(g)["w"].file) for g in written]
        assert placed == [0, 1] * 4  # every step's groups alternate: both drives read and write at once
        for g in written:
            assert swapper.io.of(swapper.records(g)["w"].file) is swapper.io.handles[placed[int(g[1:])]]
        read = swapper.swap_in(list(written))
        back = read.wait()
        assert all(torch.equal(back[g]["w"], t["w"]) for g, t in written.items())
        read.release()
        runs = swapper.layout.folders
    assert all(_run_folders(base) == [] for base in two) and not any(os.path.exists(r) for r in runs)


def test_shares_follow_the_measured_speeds(two):
    config = SwapConfig(folder=two, folder_speeds=[3.0, 1.0], pin=False)
    with TensorSwapper(config) as swapper:
        swapper.swap_out({f"g{i}": {"w": torch.ones(10)} for i in range(8)}).wait()
        drives = [swapper.layout.drive(swapper.records(f"g{i}")["w"].file) for i in range(8)]
    assert drives.count(0) == 6 and drives.count(1) == 2


def test_folders_on_one_device_are_counted_once_with_a_warning(tmp_path):
    from deepoffload.swap.layouts.multi_folder import distinct_drives

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.warns(UserWarning, match="same device .* counted once"):
        kept, weights = distinct_drives([str(tmp_path / "a"), str(tmp_path / "b")], [2.0, 1.0])
    assert kept == [str(tmp_path / "a")] and weights == [2.0]
    with pytest.warns(UserWarning, match="counted once"):
        with TensorSwapper(SwapConfig(folder=[str(tmp_path / "a"), str(tmp_path / "b")], pin=False)) as swapper:
            assert len(swapper.io.handles) == 1 and len(swapper.layout.folders) == 1
    assert os.listdir(tmp_path / "b") == []


def test_a_missing_folder_is_an_error_naming_it_and_nothing_is_left(tmp_path):
    (tmp_path / "a").mkdir()
    missing = str(tmp_path / "not-mounted")
    with pytest.raises(FileNotFoundError, match="not-mounted does not exist") as caught:
        TensorSwapper(SwapConfig(folder=[str(tmp_path / "a"), missing], pin=False))
    assert caught.value.filename == missing and caught.value.errno == errno.ENOENT
    assert os.listdir(tmp_path / "a") == [] and not os.path.exists(missing)


def test_a_full_drive_names_its_path_offset_and_errno_and_nothing_is_lost():
    with _drives(1, size=32 << 20) as roomy, _drives(1, kind="tmpfs", size=1 << 20) as tiny:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (tmpfs keeps files in memory: warned, and meant here)
            swapper = TensorSwapper(SwapConfig(folder=[roomy.folders[0], tiny.folders[0]], pin=False))
        small, big = torch.randn(1000), torch.randn(1 << 19)  # the second group goes to the 1 MiB drive
        before = big.clone()
        with pytest.raises(OSError) as caught:
            swapper.swap_out({"small": {"w": small}, "big": {"w": big}}).wait()
        error = caught.value
        assert error.errno == errno.ENOSPC and error.filename.startswith(tiny.folders[0])
        assert "at offset 0" in str(error) and tiny.folders[0] in str(error)
        assert torch.equal(big, before) and not swapper.has("big")  # the caller's tensor is the copy that counts
        swapper.swap_out({"small": {"w": small}}).wait()  # the other drive goes on
        read = swapper.swap_in(["small"])
        assert torch.equal(read.wait()["small"]["w"], small)
        read.release()
        swapper.close()
        assert _run_folders(roomy.folders[0]) == [] and _run_folders(tiny.folders[0]) == []


def test_offloaded_parameters_keep_the_weight_resident_when_a_drive_fills():
    """A fused step's write to a full drive fails naming it; the block stays in memory, the only valid copy."""
    with _drives(1, size=32 << 20) as roomy, _drives(1, kind="tmpfs", size=256 << 10) as tiny:
        model = torch.nn.Sequential(*[torch.nn.Linear(200, 200) for _ in range(4)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(OSError) as caught:
                offload_parameters(model, [roomy.folders[0], tiny.folders[0]])
        assert caught.value.errno == errno.ENOSPC and tiny.folders[0] in str(caught.value)
        assert all(p.device.type == "cpu" and p.numel() for p in model.parameters())  # nothing was freed
        assert _run_folders(roomy.folders[0]) == [] and _run_folders(tiny.folders[0]) == []


def test_offloaded_adam_over_two_drives_is_bit_identical_to_in_memory(two):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 70)) for _ in range(6)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.Adam(reference, lr=0.01)
    config = SwapConfig(folder=two, chunk_bytes=256 << 10, pin=False)  # one chunk (one extent) per parameter
    with OffloadedOptimizer(torch.optim.Adam, params, config, lr=0.01) as opt:
        packs = opt.swapper.layout.pack_files()
        for step in range(3):
            for p, r in zip(params, reference):
                g = torch.randn_like(p, generator=torch.Generator().manual_seed(step))
                p.grad, r.grad = g.clone(), g.clone()
            opt.step()
            plain.step()
        assert all(os.path.getsize(pack) > 0 for pack in packs)  # both drives hold state
    assert all(torch.equal(p, r) for p, r in zip(params, reference))


def test_every_drive_is_cleaned_by_the_next_run_after_a_crash(two):
    child = textwrap.dedent(f"""
        import os, torch
        from deepoffload import SwapConfig, TensorSwapper
        s = TensorSwapper(SwapConfig(folder={two!r}, pin=False))
        s.swap_out({{"a": {{"w": torch.ones(10)}}, "b": {{"w": torch.ones(10)}}}}).wait()
        os._exit(0)  # dies without close() or exit handlers
    """)
    subprocess.run([sys.executable, "-c", child], check=True, cwd=REPO)
    assert all(len(_run_folders(base)) == 1 for base in two)  # the dead run's files on both drives
    with TensorSwapper(SwapConfig(folder=two, pin=False)) as swapper:
        mine = [os.path.basename(f) for f in swapper.layout.folders]
        assert [_run_folders(base) for base in two] == [[mine[0]], [mine[1]]]


def test_from_pretrained_trains_over_two_drives_bit_identical_to_in_memory(two, tmp_path):
    """``path=[a, b]`` through ``from_pretrained`` (hence ``offload_parameters``): both drives hold blocks, and fused
    training gives the in-memory losses and weights bit for bit."""
    transformers = pytest.importorskip("transformers")
    import deepoffload
    from deepoffload import TrainOptions
    from tests.support.stepping import offload_step

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    reference.save_pretrained(tmp_path / "tiny")
    plain = torch.optim.Adam(reference.parameters(), lr=1e-2)
    model, off = deepoffload.from_pretrained(
        tmp_path / "tiny", path=two, train=TrainOptions(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    )
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with off:
        assert all(_run_folders(base) for base in two)
        files = [os.listdir(os.path.join(base, _run_folders(base)[0])) for base in two]
        assert all(any(name.endswith(".swp") for name in names) for names in files)  # blocks on both drives
        for _ in range(3):
            loss = model(ids, labels=ids).loss
            loss.backward()
            offload_step(off)()
            expected = reference(ids, labels=ids).loss
            expected.backward()
            plain.step()
            plain.zero_grad()
            assert loss.item() == expected.item()
        state = {k: v.clone() for k, v in off.state_dict().items()}
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_a_slow_drive_does_not_hold_back_the_writes_to_the_others():
    """Drive 0 throttled to 2 MB/s, drive 1 not: a write to drive 1 submitted after a 6 MiB write to drive 0 (3 s
    there) completes while that one is still in flight: each drive has its own queue."""
    reason = unavailable("loop", throttle=True)
    if reason is not None:
        pytest.skip(reason)
    with Drives(2, size=32 << 20, bps=2_000_000) as drives:
        fast = os.stat(drives.devices[1]).st_rdev
        for key in ("read", "write"):  # (0 removes drive 1's limit)
            (drives.cgroup / f"blkio.throttle.{key}_bps_device").write_text(f"{os.major(fast)}:{os.minor(fast)} 0")
        with drives.throttled():
            swapper = TensorSwapper(SwapConfig(folder=drives.folders, pin=False))
            slow = swapper.swap_out({"a": {"w": torch.ones(6 << 18)}})  # the first group: drive 0
            quick = swapper.swap_out({"b": {"w": torch.ones(6 << 18)}})  # the second: drive 1
            assert [swapper.layout.drive(swapper.layout.group_file(g)) for g in "ab"] == [0, 1]
            quick.wait()
            assert not slow.done(), "the write to the fast drive waited for the slow drive's"
            slow.wait()
            swapper.close()
