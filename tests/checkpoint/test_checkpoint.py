"""deepoffload.save / save_async / load: torch.save's exact bytes, torch.load's exact objects, atomic replacement,
errors that name the checkpoint, checksums."""

from __future__ import annotations

import errno
import io
import os
import pickle
import threading
import warnings

import pytest
import torch

import deepoffload
from deepoffload.checkpoint import api
from deepoffload.errors import CheckpointError
from deepoffload.formats.torch_zip import streams
from deepoffload.swap.tensor_swapper import ChecksumError

MiB = 1 << 20


def assert_same(a, b, where="obj"):
    """Same structure, same types, tensors with the same dtype, shape, strides and bits."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), where
        assert a.device == b.device and a.storage_offset() == b.storage_offset(), where
        if a.is_quantized:
            a, b = a.int_repr(), b.int_repr()
        assert torch.equal(
            a.reshape(-1).view(torch.uint8) if a.numel() and a.is_contiguous() else a,
            b.reshape(-1).view(torch.uint8) if b.numel() and b.is_contiguous() else b,
        ), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def training_state(seed=0, width=64):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(3):
        model(torch.randn(5, width)).sum().backward()
        opt.step()
        sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "step": 3,
        "note": "epoch 1",
    }


def odd_tensors():
    base = torch.arange(24, dtype=torch.float32)
    return {
        "bool": torch.tensor([True, False, True]),
        "int8": torch.arange(-5, 5, dtype=torch.int8),
        "uint16": torch.arange(7).to(torch.uint16),
        "f16": torch.randn(5).half(),
        "bf16": torch.randn(5).bfloat16(),
        "f8": torch.randn(6).to(torch.float8_e4m3fn),
        "c64": torch.randn(4, dtype=torch.complex64),
        "f64": torch.randn(3, dtype=torch.float64),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0),
        "empty2d": torch.empty(3, 0, dtype=torch.int64),
        "base": base,
        "view": base[3:9],
        "matrix": base.view(4, 6),
        "transposed": base.view(4, 6).t(),
        "strided": base[::5],
        "same": base,
    }


def test_bytes_are_exactly_torch_saves(scratch):
    for i, obj in enumerate([training_state(), odd_tensors(), torch.randn(3, 5), [1, "x", None]]):
        deepoffload.save(obj, scratch / f"c{i}.pt")
        expected = io.BytesIO()
        torch.save(obj, expected)
        assert (scratch / f"c{i}.pt").read_bytes() == expected.getvalue()


def test_round_trip_of_training_state_with_both_loaders(scratch):
    state = training_state()
    deepoffload.save(state, scratch / "ckpt.pt")
    assert_same(deepoffload.load(scratch / "ckpt.pt"), state)
    assert_same(torch.load(scratch / "ckpt.pt"), state)
    assert sorted(os.listdir(scratch)) == ["ckpt.pt"], "no temporary file is left behind"


def test_restored_training_continues_identically(scratch):
    def run(resume_from=None):
        torch.manual_seed(1)
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        if resume_from is not None:
            state = deepoffload.load(resume_from)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"])
        for step in range(0 if resume_from is None else 2, 4):
            model(torch.randn(4, 8)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if step == 1 and resume_from is None:
                deepoffload.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(),
                        "rng": torch.get_rng_state(),
                    },
                    scratch / "r.pt",
                )
        return model.weight.detach().clone()

    # the first run trains steps 0..3 and checkpoints after step 1; the second resumes there and runs steps 2..3
    uninterrupted = run()
    resumed = run(scratch / "r.pt")
    assert torch.equal(uninterrupted, resumed)


def test_views_shared_storages_odd_dtypes_empty_and_noncontiguous(scratch):
    obj = odd_tensors()
    deepoffload.save(obj, scratch / "odd.pt")
    for loaded in (deepoffload.load(scratch / "odd.pt"), torch.load(scratch / "odd.pt")):
        assert_same(loaded, obj)
        assert loaded["same"] is loaded["base"], "the same tensor stays one object"
        for name in ("view", "matrix", "transposed", "strided"):
            assert loaded[name].untyped_storage().data_ptr() == loaded["base"].untyped_storage().data_ptr(), name
        loaded["base"][4] = -1
        assert loaded["view"][1] == -1 and loaded["transposed"][4, 0] == -1, "views still share memory"


def test_we_read_torch_saves_files_including_the_legacy_format(scratch):
    torch.save({"state": training_state(), "odd": odd_tensors()}, scratch / "zip.pt")
    # (torch.load itself cannot read the newer dtypes from the legacy format)
    torch.save(training_state(), scratch / "legacy.pt", _use_new_zipfile_serialization=False)
    for name in ("zip.pt", "legacy.pt"):
        assert_same(deepoffload.load(scratch / name), torch.load(scratch / name))


def test_large_tensors_span_several_staging_buffers(scratch, monkeypatch):
    monkeypatch.setattr(streams, "STAGING_BYTES", 1 * MiB)
    monkeypatch.setattr(streams, "DIRECT_READ_MIN", 4096)
    g = torch.Generator().manual_seed(3)
    obj = {
        "big": torch.randn(3 * MiB // 4 + 17, generator=g),
        "small": torch.randn(10, generator=g),
        "mid": torch.randint(0, 255, (MiB + 4097,), dtype=torch.uint8, generator=g),
    }
    deepoffload.save(obj, scratch / "big.pt")
    expected = io.BytesIO()
    torch.save(obj, expected)
    assert (scratch / "big.pt").read_bytes() == expected.getvalue()
    assert_same(deepoffload.load(scratch / "big.pt", checksum=True), obj)


def test_map_location_and_weights_only_behave_as_in_torch_load(scratch):
    deepoffload.save({"w": torch.ones(3)}, scratch / "w.pt")
    for location in ("meta", torch.device("meta"), {"cpu": "meta"}, lambda storage, loc: storage):
        ours, theirs = deepoffload.load(scratch / "w.pt", location), torch.load(scratch / "w.pt", location)
        assert ours["w"].device == theirs["w"].device
    deepoffload.save({"f": threading.Lock}, scratch / "unsafe.pt")  # a global weights_only refuses
    with pytest.raises(pickle.UnpicklingError):
        deepoffload.load(scratch / "unsafe.pt")
    assert deepoffload.load(scratch / "unsafe.pt", weights_only=False)["f"] is threading.Lock


def test_mmap_argument_behaves_as_in_torch_load(scratch):
    # torch.load's mmap= reached torch's unpickler: "Unpickler.__init__() got an unexpected keyword argument 'mmap'"
    obj = {"a": torch.randn(8, 8), "n": 3}
    obj["view"] = obj["a"][2:4]
    deepoffload.save(obj, scratch / "m.pt")
    for mmap in (True, False, None):
        loaded = deepoffload.load(scratch / "m.pt", mmap=mmap, checksum=True)
        assert_same(loaded, obj)
        assert loaded["view"].untyped_storage().data_ptr() == loaded["a"].untyped_storage().data_ptr()
    torch.save(obj, scratch / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError, match="mmap can only be used with files saved with"):  # torch's own refusal
        deepoffload.load(scratch / "legacy.pt", mmap=True)


def test_file_objects_are_refused_with_a_message_saying_what_to_use(scratch):
    for call in (
        lambda: deepoffload.save({}, io.BytesIO()),
        lambda: deepoffload.save_async({}, io.BytesIO()),
        lambda: deepoffload.load(io.BytesIO(b"PK")),
    ):
        with pytest.raises(TypeError, match=r"takes a file path \(str or os.PathLike\), not BytesIO; use torch\."):
            call()


def test_files_that_are_not_checkpoints_raise_naming_the_file_and_why(scratch):
    # torch.load raises EOFError(''), KeyError(101), miniz's "failed finding central directory" or a weights-only
    # refusal for these, none naming the file; with checksum=True a truncated file was called "not zip-format"
    deepoffload.save({"t": torch.ones(1000)}, scratch / "good.pt")
    whole = (scratch / "good.pt").read_bytes()
    (scratch / "empty.pt").write_bytes(b"")
    (scratch / "cut.pt").write_bytes(whole[: len(whole) // 2])
    (scratch / "text.pt").write_text("not a checkpoint\n")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file({"t": torch.ones(3)}, scratch / "w.pt")
    cases = {
        "empty.pt": "the file is empty",
        "cut.pt": "no zip directory at its end: it is truncated or damaged",
        "text.pt": "neither a zip-format nor a legacy torch.save file",
        "w.pt": "safetensors file: read it with deepoffload.formats.load_file",
    }
    for name, why in cases.items():
        for kwargs in ({}, {"checksum": True}, {"map_location": {"cpu": "cpu"}}, {"mmap": True}):
            with pytest.raises(deepoffload.CheckpointError, match=why) as info:
                deepoffload.load(scratch / name, **kwargs)
            assert str(scratch / name) in str(info.value), (name, kwargs)


def test_a_safetensors_path_loads_as_torch_load_loads_it(scratch):
    # torch.load reads a *.safetensors path with the safetensors library; ours raised a weights-only refusal
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(4, 3), "i": torch.arange(5)}
    safetensors_torch.save_file(tensors, scratch / "m.safetensors")
    for kwargs in (
        {},
        {"map_location": "cpu"},
        {"map_location": torch.device("cpu")},
        {"mmap": True},
        {"weights_only": True},
    ):
        ours, theirs = (
            deepoffload.load(scratch / "m.safetensors", **kwargs),
            torch.load(scratch / "m.safetensors", **kwargs),
        )
        assert list(ours) == list(theirs)
        for name in tensors:
            assert ours[name].device == theirs[name].device and ours[name].dtype == theirs[name].dtype
            if ours[name].device.type == "cpu":
                assert torch.equal(ours[name], theirs[name])
    with pytest.raises(RuntimeError, match="takes a device as map_location"):
        deepoffload.load(scratch / "m.safetensors", map_location={"cpu": "cpu"})
    with pytest.raises(ValueError, match="records no checksums"):
        deepoffload.load(scratch / "m.safetensors", checksum=True)


def test_a_file_replaced_while_it_is_read_is_read_again_not_mixed(scratch, monkeypatch):
    # the op reads by path: another process's save renamed over the file mid-load gave tensors half old, half new
    from deepoffload.formats.torch_zip import whole_file

    path, newer = scratch / "latest.pt", scratch / "newer.pt"
    deepoffload.save({"w": torch.zeros(1 << 20)}, path)  # 4 MiB, read in 1 MiB requests
    monkeypatch.setattr(whole_file, "WHOLE_READ_CHUNK", 1 << 20)
    original, chunks = whole_file.prefault, []

    def replace_at_the_third_chunk(chunk):
        chunks.append(chunk.numel())
        if len(chunks) == 3:
            deepoffload.save({"w": torch.ones(1 << 20)}, newer)
            os.replace(newer, path)
        return original(chunk)

    monkeypatch.setattr(whole_file, "prefault", replace_at_the_third_chunk)
    assert torch.equal(deepoffload.load(path)["w"], torch.ones(1 << 20))
    assert len(chunks) > 4, "read again"

    def replace_at_every_chunk(chunk):
        deepoffload.save({"w": torch.full((1 << 20,), float(len(chunks)))}, newer)
        os.replace(newer, path)
        chunks.append(chunk.numel())
        return original(chunk)

    monkeypatch.setattr(whole_file, "prefault", replace_at_every_chunk)
    with pytest.raises(deepoffload.CheckpointError, match="replaced or rewritten while being read, 3 times"):
        deepoffload.load(path)


def test_quantized_and_sparse_tensors(scratch):
    obj = {"q": torch.quantize_per_tensor(torch.randn(6), 0.1, 3, torch.qint8), "sparse": torch.eye(4).to_sparse()}
    deepoffload.save(obj, scratch / "q.pt")
    loaded = deepoffload.load(scratch / "q.pt", weights_only=False)
    assert torch.equal(loaded["q"].int_repr(), obj["q"].int_repr()) and loaded["q"].q_scale() == obj["q"].q_scale()
    assert torch.equal(loaded["sparse"].to_dense(), torch.eye(4))


def flip_byte_in(path, needle: bytes):
    data = bytearray(path.read_bytes())
    at = data.index(needle)
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checksums_catch_a_flipped_byte(scratch):
    marker = torch.tensor([1234.5678] * 64, dtype=torch.float64)
    deepoffload.save({"t": marker}, scratch / "c.pt")
    assert_same(deepoffload.load(scratch / "c.pt", checksum=True), {"t": marker})
    flip_byte_in(scratch / "c.pt", marker[:1].numpy().tobytes())
    with pytest.raises(ChecksumError, match="data/0"):
        deepoffload.load(scratch / "c.pt", checksum=True)
    assert not torch.equal(deepoffload.load(scratch / "c.pt")["t"], marker), "unchecked, the change goes through"


def test_checksums_can_be_skipped_and_then_are_not_claimed(scratch):
    deepoffload.save({"t": torch.ones(100)}, scratch / "n.pt", checksum=False)
    assert torch.equal(torch.load(scratch / "n.pt")["t"], torch.ones(100)), "torch.load reads it"
    with pytest.raises(ChecksumError, match="no checksums"):
        deepoffload.load(scratch / "n.pt", checksum=True)


def test_missing_folder_names_the_checkpoint(scratch):
    target = scratch / "absent" / "x.pt"
    with pytest.raises(FileNotFoundError) as info:
        deepoffload.save({"a": torch.ones(2)}, target)
    assert str(target) in str(info.value)
    assert info.value.filename == str(target)
    with pytest.raises(FileNotFoundError) as info:
        deepoffload.load(target)
    assert isinstance(info.value, deepoffload.CheckpointNotFoundError) and isinstance(info.value, CheckpointError)
    assert info.value.errno == errno.ENOENT and info.value.filename == str(target)


def test_serialization_error_leaves_the_previous_checkpoint(scratch):
    deepoffload.save({"v": 1}, scratch / "p.pt")
    before = (scratch / "p.pt").read_bytes()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        deepoffload.save({"f": lambda: 0}, scratch / "p.pt")  # lambdas do not pickle
    assert (scratch / "p.pt").read_bytes() == before
    assert sorted(os.listdir(scratch)) == ["p.pt"]


def test_overwrite_keeps_the_permission_bits(scratch):
    deepoffload.save({"v": 1}, scratch / "m.pt")
    os.chmod(scratch / "m.pt", 0o640)
    deepoffload.save({"v": 2}, scratch / "m.pt")
    assert (os.stat(scratch / "m.pt").st_mode & 0o777) == 0o640
    assert deepoffload.load(scratch / "m.pt") == {"v": 2}


@pytest.mark.root
@pytest.mark.parametrize("kind", ["ext4", "tmpfs"])
def test_disk_full_raises_and_leaves_the_previous_checkpoint_intact(small_fs, kind):
    folder = small_fs(16 * MiB, kind)
    old = {"model": torch.randn(MiB // 4)}  # 1 MiB
    deepoffload.save(old, folder / "ckpt.pt")
    before = (folder / "ckpt.pt").read_bytes()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "deepoffload: the filesystem .* refuses O_DIRECT", RuntimeWarning)
        with pytest.raises(OSError) as info:
            deepoffload.save({"model": torch.randn(24 * MiB // 4)}, folder / "ckpt.pt")  # 24 MiB: does not fit
        assert info.value.errno == errno.ENOSPC, info.value
        assert str(folder / "ckpt.pt") in str(info.value)
        assert (folder / "ckpt.pt").read_bytes() == before
        assert os.listdir(folder) == ["ckpt.pt"] or sorted(os.listdir(folder)) == ["ckpt.pt", "lost+found"]
        future = deepoffload.save_async({"model": torch.randn(24 * MiB // 4)}, folder / "ckpt.pt")
        with pytest.raises(OSError) as info:
            future.result(timeout=120)
        assert info.value.errno == errno.ENOSPC
        assert (folder / "ckpt.pt").read_bytes() == before
        deepoffload.save({"model": torch.ones(10)}, folder / "ckpt.pt")  # and the space came back
    assert torch.equal(torch.load(folder / "ckpt.pt")["model"], torch.ones(10))


@pytest.mark.root
def test_read_only_filesystem_names_the_checkpoint(small_fs):
    folder = small_fs(4 * MiB, "tmpfs", read_only=True)
    with pytest.raises(OSError) as info:
        deepoffload.save({"a": 1}, folder / "ro.pt")
    assert info.value.errno == errno.EROFS and str(folder / "ro.pt") in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_permission_denied_names_the_checkpoint(scratch):
    locked = scratch / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(PermissionError) as info:
        deepoffload.save({"a": 1}, locked / "x.pt")
    assert str(locked / "x.pt") in str(info.value)


# -- asynchronous save --------------------------------------------------------------------------------------------
def test_async_save_snapshots_at_the_call(scratch):
    state = training_state(width=256)
    expected = io.BytesIO()
    torch.save(state, expected)
    future = deepoffload.save_async(state, scratch / "a.pt")
    for tensor in state["model"].values():  # training goes on right away
        tensor.add_(1)
    state["optimizer"]["param_groups"][0]["lr"] = 123.0
    state["note"] = "changed"
    assert future.result(timeout=120) == str(scratch / "a.pt")
    assert (scratch / "a.pt").read_bytes() == expected.getvalue()


def test_async_saves_run_in_order_and_report_errors(scratch):
    futures = [deepoffload.save_async({"i": torch.full((1000,), i)}, scratch / "o.pt") for i in range(3)]
    bad = deepoffload.save_async({"i": torch.ones(1)}, scratch / "missing" / "o.pt")
    assert [f.result(timeout=120) for f in futures] == [str(scratch / "o.pt")] * 3
    assert torch.equal(deepoffload.load(scratch / "o.pt")["i"], torch.full((1000,), 2))
    with pytest.raises(FileNotFoundError, match="missing"):
        bad.result(timeout=120)


def test_a_save_or_load_after_save_async_to_the_same_path_sees_it(scratch, monkeypatch):
    # save() did not wait for a pending save_async: the async file's rename came later and put the older
    # checkpoint back under the path, silently; load() read the checkpoint before it (or found none)
    original = api._write_file

    def slow_in_background(*args):
        if threading.current_thread() is not threading.main_thread():
            threading.Event().wait(0.5)  # the background write is still going when save() runs
        return original(*args)

    monkeypatch.setattr(api, "_write_file", slow_in_background)
    pending = deepoffload.save_async({"step": 1}, scratch / "c.pt")
    deepoffload.save({"step": 2}, scratch / "c.pt")
    assert pending.result(timeout=120) == str(scratch / "c.pt")
    assert deepoffload.load(scratch / "c.pt")["step"] == 2
    deepoffload.save_async({"step": 3}, scratch / "c.pt")
    assert deepoffload.load(scratch / "c.pt")["step"] == 3, "load reads what was saved before it"
    deepoffload.save_async({"step": 4}, scratch / "new.pt")
    assert deepoffload.load(scratch / "new.pt")["step"] == 4, "not FileNotFoundError"


def test_async_saves_reuse_the_snapshot_memory_only_after_the_previous_write(scratch):
    """Back-to-back saves share one kept arena: the second call must wait for the first file to be written before
    copying into it (else the first file would hold the second state), and a larger state gets a larger arena."""
    g = torch.Generator().manual_seed(3)
    states = [{"w": torch.randn(8 * MiB, generator=g), "i": i} for i in range(2)]  # 32 MiB each: writes take time
    states.append({"w": torch.randn(9 * MiB, generator=g), "b": torch.arange(7)})
    expected = []
    for state in states:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        expected.append(buffer.getvalue())
    futures = [deepoffload.save_async(state, scratch / f"{i}.pt") for i, state in enumerate(states[:2])]
    arena = api._arena.data_ptr()
    for i, future in enumerate(futures):
        future.result(timeout=120)
        assert (scratch / f"{i}.pt").read_bytes() == expected[i]
    assert api._arena.data_ptr() == arena  # the same memory, not a new allocation
    deepoffload.save_async(states[2], scratch / "2.pt").result(timeout=120)
    assert api._arena.numel() >= 36 * MiB
    assert (scratch / "2.pt").read_bytes() == expected[2]


def test_async_save_refuses_unpicklable_objects_at_the_call(scratch):
    with pytest.raises(Exception, match="lambda|pickle"):
        deepoffload.save_async({"f": lambda: 0}, scratch / "x.pt")
    assert not os.listdir(scratch)


def test_reader_returns_the_files_bytes_for_any_read_order(scratch, monkeypatch):
    monkeypatch.setattr(streams, "STAGING_BYTES", 64 << 10)
    monkeypatch.setattr(streams, "DIRECT_READ_MIN", 4096)
    data = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    (scratch / "f.bin").write_bytes(data.numpy().tobytes())
    g = torch.Generator().manual_seed(6)
    with streams.DirectReader(scratch / "f.bin") as reader:
        for _ in range(200):  # forwards, backwards, across chunks, small and large, past the end
            start = int(torch.randint(0, 1_000_010, (1,), generator=g))
            length = int(torch.randint(0, 300_000 if _ % 3 else 5000, (1,), generator=g))
            out = bytearray(length)
            reader.seek(start)
            got = reader.readinto(out)
            assert got == max(0, min(length, 1_000_003 - start))
            assert bytes(out[:got]) == data[start : start + got].numpy().tobytes()


def test_reader_reads_each_byte_once_when_headers_are_read_before_data(scratch, monkeypatch):
    """DCP's files hold one torch.save archive per tensor, and torch's zip reader reads an archive's end before its
    data: that small read must not move the read-ahead window past the data (which was then read a second time,
    synchronously, as a read behind the window)."""
    chunk = 64 << 10
    monkeypatch.setattr(streams, "STAGING_BYTES", chunk)
    monkeypatch.setattr(streams, "DIRECT_READ_MIN", 4096)
    item = 3 * chunk
    data = torch.randint(0, 256, (8 * item,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    (scratch / "f.bin").write_bytes(data.numpy().tobytes())
    requested = []
    handle_class = type(streams.shared_handle())
    for name in ("read", "read_async"):
        real = getattr(handle_class, name)

        def counting(self, tensor, *args, _real=real, **kwargs):
            requested.append(tensor.numel())
            return _real(self, tensor, *args, **kwargs)

        monkeypatch.setattr(handle_class, name, counting)
    with streams.DirectReader(scratch / "f.bin") as reader:
        for start in range(0, data.numel(), item):
            for offset, length in ((start + item - 100, 100), (start, 30), (start + 64, item - 164)):
                out = bytearray(length)
                reader.seek(offset)
                assert reader.readinto(out) == length
                assert out == data[offset : offset + length].numpy().tobytes()
    assert sum(requested) == data.numel(), requested


def test_pending_async_save_completes_before_the_interpreter_exits(scratch):
    import subprocess
    import sys

    code = (
        "import torch, deepoffload\n"
        "g = torch.Generator().manual_seed(0)\n"
        f"deepoffload.save_async({{'w': torch.randn(8_000_000, generator=g)}}, {str(scratch / 'exit.pt')!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    expected = torch.randn(8_000_000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.load(scratch / "exit.pt")["w"], expected)


def test_a_failed_read_raises_and_its_chunk_is_never_served(scratch, monkeypatch):
    monkeypatch.setattr(streams, "STAGING_BYTES", 64 << 10)
    monkeypatch.setattr(streams, "DIRECT_READ_MIN", 4096)
    (scratch / "f.bin").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    with streams.DirectReader(scratch / "f.bin") as reader:
        os.truncate(scratch / "f.bin", 100_000)  # the reads past here now fail
        for _ in range(2):
            reader.seek(200_000)
            with pytest.raises(OSError) as info:
                reader.readinto(bytearray(10_000))
            assert info.value.errno == errno.ENODATA and "f.bin" in str(info.value)
        reader.seek(0)
        out = bytearray(50_000)
        assert reader.readinto(out) == 50_000 and bytes(out) == (bytes(range(256)) * 4096)[:50_000]


def test_a_symlinked_checkpoint_is_written_through_the_link(scratch):
    (scratch / "real").mkdir()
    deepoffload.save({"v": 1}, scratch / "real" / "c.pt")
    os.symlink(scratch / "real" / "c.pt", scratch / "latest.pt")
    deepoffload.save({"v": 2}, scratch / "latest.pt")
    assert os.path.islink(scratch / "latest.pt") and deepoffload.load(scratch / "real" / "c.pt") == {"v": 2}
    assert sorted(os.listdir(scratch / "real")) == ["c.pt"]


ACCELERATOR = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


@pytest.mark.skipif(ACCELERATOR is None, reason="no accelerator on this machine")
def test_accelerator_tensors_save_async_and_load_to_the_device(scratch):
    device = ACCELERATOR.type
    state = {"w": torch.randn(1000, device=device), "cpu": torch.arange(5)}
    expected = {"w": state["w"].cpu(), "cpu": state["cpu"].clone()}
    future = deepoffload.save_async(state, scratch / "device.pt")
    state["w"].add_(1)
    future.result(timeout=120)
    loaded = deepoffload.load(scratch / "device.pt")
    assert loaded["w"].device.type == device and torch.equal(loaded["w"].cpu(), expected["w"])
    assert torch.equal(deepoffload.load(scratch / "device.pt", map_location="cpu")["w"], expected["w"])


def test_records_that_look_like_zip_descriptors_are_saved_exactly(scratch):
    """The CRCs are filled in by parsing torch's zip stream: data that looks like a data descriptor (signature,
    zero CRC, sizes equal to the bytes so far) must still be taken for data."""
    fake16 = torch.frombuffer(bytearray(b"PK\x07\x08" + bytes(12)), dtype=torch.uint8)
    fake24 = torch.frombuffer(bytearray(b"PK\x07\x08" + bytes(20)), dtype=torch.uint8)
    obj = {"d16": fake16, "d24": fake24, "empty": torch.empty(0), "after": torch.arange(5)}
    deepoffload.save(obj, scratch / "d.pt")
    expected = io.BytesIO()
    torch.save(obj, expected)
    assert (scratch / "d.pt").read_bytes() == expected.getvalue()
    assert_same(deepoffload.load(scratch / "d.pt", checksum=True), obj)


class _Sink:
    """Stands in for DirectWriter under CrcFiller: keeps the bytes."""

    path = "sink"
    error = None

    def __init__(self):
        self.data = bytearray()

    def tell(self):
        return len(self.data)

    def write(self, data):
        self.data += memoryview(data).cast("B")

    def write_digest(self, data, digest):
        view = memoryview(data).cast("B")
        copy = torch.frombuffer(bytearray(view), dtype=torch.uint8) if view.nbytes else torch.empty(0)
        if view.nbytes:
            digest(copy.data_ptr(), view.nbytes)
        self.write(view)


def zip_stream(obj) -> bytes:
    """What torch's zip writer passes to its sink for ``obj`` with its CRC off (the stream CrcFiller parses)."""
    from deepoffload.formats.torch_zip.torch_format import record

    sink = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(sink, False, torch.serialization._get_storage_alignment())
    for name, data, nbytes in record(obj):
        writer.write_record(name, data, nbytes)
    writer.write_end_of_file()
    return sink.getvalue()


@pytest.mark.parametrize("damage", ["signature", "compressed", "descriptor_size", "central_name", "truncated"])
def test_a_zip_stream_it_does_not_know_is_refused(damage):
    from deepoffload.formats.torch_zip.zip_crc import CrcFiller, ZipLayoutError

    stream = bytearray(zip_stream({"w": torch.arange(100)}))
    if damage == "signature":
        stream[:4] = b"PK\x09\x09"
    elif damage == "compressed":
        stream[8] = 8  # deflate
    elif damage == "descriptor_size":
        at = stream.index(b"PK\x07\x08")
        stream[at + 8] ^= 1
    elif damage == "central_name":
        at = stream.index(b"PK\x01\x02")
        stream[at + 46] ^= 0x20  # the first entry's name no longer matches its record
    else:
        del stream[stream.index(b"PK\x01\x02") :]
    filler = CrcFiller(_Sink())
    with pytest.raises(ZipLayoutError, match="checksum=False"):
        filler.write(stream)
        filler.finish()


def test_crc_filler_reproduces_torchs_crcs_and_serialization_id():
    from deepoffload.formats.torch_zip.zip_crc import CrcFiller

    obj = training_state()
    sink = _Sink()
    filler = CrcFiller(sink)
    for piece in _writes(zip_stream(obj)):
        filler.write(piece)
    filler.finish()
    expected = io.BytesIO()
    torch.save(obj, expected)
    assert bytes(sink.data) == expected.getvalue()


def _writes(stream: bytes):
    """``stream`` cut where torch's writer cut it (replayed through a recording sink)."""
    pieces = []

    class Recording(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            pieces.append(bytes(memoryview(b).cast("B")))
            return len(pieces[-1])

    from deepoffload.formats.torch_zip.torch_format import record

    writer = torch._C.PyTorchFileWriter(Recording(), False, torch.serialization._get_storage_alignment())
    for name, data, nbytes in record(training_state()):
        writer.write_record(name, data, nbytes)
    writer.write_end_of_file()
    assert b"".join(pieces) == stream
    return pieces


def test_whole_file_load_shares_one_buffer_that_outlives_the_other_tensors(scratch):
    import gc

    state = training_state()
    deepoffload.save(state, scratch / "w.pt")
    loaded = deepoffload.load(scratch / "w.pt")
    weight = loaded["model"]["0.weight"]
    expected = state["model"]["0.weight"].clone()
    del loaded
    gc.collect()
    junk = [torch.full((1 << 16,), 7.0) for _ in range(64)]  # reuse of freed memory would show below
    assert torch.equal(weight, expected) and len(junk) == 64
    assert_same(deepoffload.load(scratch / "w.pt", map_location="cpu"), state)
    assert_same(deepoffload.load(scratch / "w.pt", map_location=torch.device("cpu"), weights_only=True), state)


def test_checksums_of_a_truncated_file_are_refused_not_read_past_its_end(scratch):
    deepoffload.save({"w": torch.randn(100_000)}, scratch / "t.pt")
    data = (scratch / "t.pt").read_bytes()
    from deepoffload.formats.torch_zip.zip_crc import ZipChecksums

    checker = ZipChecksums(str(scratch / "t.pt"))
    with pytest.raises(ChecksumError, match="truncated"):
        checker.verify_memory(torch.frombuffer(bytearray(data[:1000]), dtype=torch.uint8))


@pytest.mark.parametrize("alignment", [64, 4096])
def test_preallocated_file_is_cut_to_exactly_torch_saves_bytes(scratch, alignment):
    """The temporary file is preallocated from an estimate of its size and cut at close to what was written: with
    long names, many small records and a larger storage alignment no preallocated tail may remain."""
    from torch.utils.serialization import config

    obj = {("n" * 200) + str(i): torch.arange(i) for i in range(50)}
    old = config.save.storage_alignment
    config.save.storage_alignment = alignment
    try:
        deepoffload.save(obj, scratch / "p.pt")
        expected = io.BytesIO()
        torch.save(obj, expected)
    finally:
        config.save.storage_alignment = old
    assert (scratch / "p.pt").read_bytes() == expected.getvalue()


@pytest.mark.parametrize("force", ["TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
@pytest.mark.parametrize("weights_only", [None, True, False])
def test_weights_only_environment_variables_decide_as_in_torch_load(scratch, monkeypatch, force, weights_only):
    """The whole-file path resolves weights_only itself: it must refuse exactly when torch.load refuses."""
    deepoffload.save({"f": threading.Lock, "w": torch.ones(2)}, scratch / "u.pt")
    monkeypatch.setenv(force, "1")

    def outcome(load):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return load(scratch / "u.pt", weights_only=weights_only)["f"]
        except pickle.UnpicklingError:
            return "refused"

    assert outcome(deepoffload.load) == outcome(torch.load)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_during_an_async_save_saves_on_its_own(scratch, monkeypatch):
    # the child inherited the parent's pending future but not its save thread: its own save_async waited for that
    # future forever (a DataLoader worker or a forked evaluator hung)
    started, go = threading.Event(), threading.Event()
    write = api._write_file

    def held(*args):
        started.set()
        go.wait(60)
        return write(*args)

    monkeypatch.setattr(api, "_write_file", held)
    future = deepoffload.save_async({"w": torch.arange(1000)}, scratch / "parent.pt")
    assert started.wait(60)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its own save completed in time
        import signal

        signal.alarm(30)
        try:
            api._write_file = write  # the child's save is not held
            deepoffload.save_async({"c": torch.arange(5)}, scratch / "child.pt").result(timeout=25)
            ok = torch.equal(deepoffload.load(scratch / "child.pt")["c"], torch.arange(5))
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    go.set()
    assert future.result(timeout=120) == str(scratch / "parent.pt")
    assert torch.equal(deepoffload.load(scratch / "parent.pt")["w"], torch.arange(1000))
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("checksum", [True, False])
def test_ctrl_c_during_a_save_raises_keyboardinterrupt_and_keeps_the_previous_file(scratch, monkeypatch, checksum):
    # torch's zip writer, finalized after the interrupted write, raised "enforce fail ... unexpected pos" instead
    from deepoffload.io import staged_file

    path = scratch / "c.pt"
    deepoffload.save({"w": torch.zeros(4 * MiB)}, path)
    write, calls = staged_file.StagedWriter.write, []

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return write(self, *args)

    monkeypatch.setattr(staged_file.StagedWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        deepoffload.save({"w": torch.ones(4 * MiB), "b": torch.arange(9)}, path, checksum=checksum)
    assert torch.equal(deepoffload.load(path)["w"], torch.zeros(4 * MiB))
    assert os.listdir(scratch) == ["c.pt"]  # no temporary file left
    monkeypatch.setattr(staged_file.StagedWriter, "write", write)
    deepoffload.save({"w": torch.ones(4 * MiB)}, path, checksum=checksum)
    assert torch.equal(deepoffload.load(path, checksum=checksum)["w"], torch.ones(4 * MiB))


def test_a_symlink_is_written_through_and_a_hard_link_keeps_the_old_bytes(scratch):
    # latest.pt -> ckpt-100.pt: the file named is replaced and the link stays, as torch.save writes through it
    torch.save({"a": torch.zeros(3)}, scratch / "ckpt-100.pt")
    os.symlink("ckpt-100.pt", scratch / "latest.pt")
    deepoffload.save({"a": torch.ones(3)}, scratch / "latest.pt")
    assert os.path.islink(scratch / "latest.pt")
    assert torch.equal(torch.load(scratch / "ckpt-100.pt")["a"], torch.ones(3))
    # a hard link: a new file under the name saved to; the other name keeps the old bytes
    os.link(scratch / "ckpt-100.pt", scratch / "copy.pt")
    deepoffload.save({"a": torch.full((3,), 2.0)}, scratch / "copy.pt")
    assert torch.equal(torch.load(scratch / "copy.pt")["a"], torch.full((3,), 2.0))
    assert torch.equal(torch.load(scratch / "ckpt-100.pt")["a"], torch.ones(3))
    assert not list(scratch.glob(".*"))  # no temporary left beside them
