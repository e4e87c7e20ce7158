"""TensorSwapper: exact round trips of any dtype and shape, per-tensor records, memory really released, errors
(failed writes keep the tensor, short files, checksums), and per-run folders."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch

from deepoffload.swap.config import SwapConfig
from deepoffload.swap.pool import trim_heap
from deepoffload.swap.tensor_swapper import ChecksumError, TensorSwapper

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (3, 1, 4, 5), (1000003,)]


def sample(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    high = 2 if dtype == torch.bool else 256  # every byte pattern, except bools other than 0 and 1
    raw = torch.randint(
        0,
        high,
        (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=g,
    )
    return raw.view(dtype).view(shape)


@pytest.fixture
def swapper(scratch):
    with TensorSwapper(SwapConfig(folder=str(scratch), chunk_bytes=1 << 20, buffer_count=2, checksum=True)) as s:
        yield s


def assert_identical(a, b):
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_shape(swapper, dtype):
    tensors = {f"t{i}": sample(dtype, shape, i) for i, shape in enumerate(SHAPES)}
    swapper.swap_out({"g": tensors}).wait()
    for key, record in swapper.records("g").items():
        t = tensors[key]
        assert (record.key, record.dtype, record.shape, record.nbytes) == (
            key,
            dtype,
            tuple(t.shape),
            t.numel() * t.element_size(),
        )
        assert record.offset % 64 == 0 and record.file.endswith("g.swp")
    read = swapper.swap_in(["g"])
    back = read.wait()["g"]
    for key, t in tensors.items():
        assert_identical(back[key], t)
    read.release()


def test_buffers_that_start_inside_their_storage(scratch, monkeypatch):
    """Buffers need not start at their storage's first byte (huge-page alignment, slices of torch's pinned memory):
    every view of one must be placed from where the buffer starts."""
    import deepoffload.swap.pool as pool

    made, original = [], pool.aligned_empty

    def offset_buffer(nbytes, dtype=torch.uint8, alignment=0, pin=True):
        whole = original(nbytes + 3 * 4096, dtype, alignment, pin)
        made.append(whole[3 * 4096 :])
        return made[-1]

    monkeypatch.setattr(pool, "aligned_empty", offset_buffer)
    tensors = {f"t{i}": sample(torch.float32, shape, i) for i, shape in enumerate(SHAPES)}
    with TensorSwapper(SwapConfig(folder=str(scratch), chunk_bytes=1 << 20, buffer_count=2)) as s:
        write = s.swap_out({"g": tensors})
        staged = write.staged()["g"]
        for key, t in tensors.items():
            if t.numel():
                assert_identical(staged[key], t)
        write.wait()
        read = s.swap_in(["g"])
        back = read.wait()["g"]
        for key, t in tensors.items():
            assert_identical(back[key], t)
        read.release()
    assert made and all(b.storage_offset() >= 3 * 4096 for b in made)


def test_groups_share_one_buffer_and_read_sized_from_own_records(swapper):
    a = {"x": torch.arange(10, dtype=torch.float32), "y": torch.tensor(3.5, dtype=torch.float64)}
    b = {"x": torch.arange(3000, dtype=torch.int16).reshape(3, 1000)}  # same key, another size and dtype
    swapper.swap_out({"a": a, "b": b}).wait()
    assert swapper.stored_bytes() == 40 + 8 + 6000
    read = swapper.swap_in(["b", "a"])
    back = read.wait()
    assert_identical(back["a"]["x"], a["x"])
    assert_identical(back["a"]["y"], a["y"])
    assert_identical(back["b"]["x"], b["x"])
    # tensors read in and written back where they sit go out without a copy; the buffer returns to the pool
    back["b"]["x"].add_(1)
    swapper.swap_out(back, staged=read).wait()
    again = swapper.swap_in(["b"])
    assert torch.equal(again.wait()["b"]["x"], b["x"] + 1)
    again.release()


def test_rewriting_a_group_waits_for_its_read(swapper):
    swapper.swap_out({"g": {"t": torch.full((1 << 20,), 1.0)}}).wait()
    read = swapper.swap_in(["g"])
    swapper.swap_out({"g": {"t": torch.full((1 << 20,), 2.0)}}).wait()  # same file, while the read may run
    assert read.wait()["g"]["t"].eq(1).all()
    read.release()
    again = swapper.swap_in(["g"])
    assert again.wait()["g"]["t"].eq(2).all()
    again.release()


def test_non_contiguous_and_views_are_staged_by_copy(swapper):
    base = torch.randn(64, 32)
    tensors = {"t": base.t(), "s": base[::3, 1:5], "e": base.expand(2, 64, 32)[1]}
    swapper.swap_out({"g": tensors}).wait()
    read = swapper.swap_in(["g"])
    for key, t in read.wait()["g"].items():
        assert torch.equal(t, tensors[key]) and t.is_contiguous()
    read.release()


def test_rejects_what_has_no_byte_buffer_and_bad_names(swapper):
    with pytest.raises(ValueError, match="sparse"):
        swapper.swap_out({"g": {"s": torch.eye(3).to_sparse()}})
    with pytest.raises(TypeError, match="not a tensor"):
        swapper.swap_out({"g": {"n": 3}})
    for bad in ("", "a/b", "..", ".hidden"):
        with pytest.raises(ValueError, match="group name"):
            swapper.swap_out({bad: {"t": torch.ones(1)}})


@pytest.mark.parametrize(
    "layout, advised",
    [("coo", "to_dense"), ("csr", "to_dense"), ("csc", "to_dense"), ("quantized", "dequantize")],
)
def test_what_has_no_byte_buffer_is_refused_before_writing_and_the_advice_swaps(swapper, layout, advised):
    dense = torch.eye(4)
    tensor = {
        "coo": lambda: dense.to_sparse(),
        "csr": lambda: dense.to_sparse_csr(),
        "csc": lambda: dense.to_sparse_csc(),
        "quantized": lambda: torch.quantize_per_tensor(dense, 0.5, 0, torch.qint8),
    }[layout]()
    kept = torch.randn(8)
    swapper.swap_out({"g": {"kept": kept}}).wait()
    with pytest.raises(ValueError, match=r"no single byte buffer; swap tensor\.to_dense\(\) or tensor\.dequantize\(\)"):
        swapper.swap_out({"g": {"kept": kept + 1, "s": tensor}})
    read = swapper.swap_in(["g"])
    assert list(read.wait()["g"]) == ["kept"] and torch.equal(read.wait()["g"]["kept"], kept)  # nothing written
    read.release()
    swapper.swap_out({"g": {"s": getattr(tensor, advised)()}}).wait()
    read = swapper.swap_in(["g"])
    assert torch.equal(read.wait()["g"]["s"], dense)
    read.release()


def test_corrupted_file_is_detected_by_checksum(swapper):
    swapper.swap_out({"g": {"t": torch.randn(5000)}}).wait()
    record = swapper.records("g")["t"]
    with open(record.file, "r+b") as f:
        f.seek(record.offset + 1234)
        byte = f.read(1)
        f.seek(record.offset + 1234)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match="checksum mismatch for 't'") as info:
        swapper.swap_in(["g"]).wait()
    assert info.value.filename == record.file and info.value.errno == errno.EIO


def test_short_file_is_an_error_naming_the_file(swapper):
    swapper.swap_out({"g": {"t": torch.randn(5000)}}).wait()
    file = swapper.records("g")["t"].file
    os.truncate(file, 4096)
    with pytest.raises(OSError) as info:
        swapper.swap_in(["g"]).wait()
    assert file in str(info.value)


def test_failed_write_keeps_the_tensor_and_drops_stale_records(swapper):
    tensor = torch.randn(1000)
    swapper.swap_out({"g": {"t": tensor}}).wait()
    file = os.path.join(swapper.folder, "g.swp")
    os.unlink(file)
    os.mkdir(file)  # the file became a folder: the next write fails (a replaced run folder is refused earlier)
    try:
        done = []
        write = swapper.swap_out({"g": {"t": tensor * 2}}, on_done=lambda: done.append(1))
        with pytest.raises(OSError) as info:
            write.wait()
        assert "g.swp" in str(info.value) and info.value.errno is not None
        assert done == [] and swapper.records("g") == {}
        assert tensor.sum().item() == tensor.sum().item()  # still ours, still valid
    finally:
        os.rmdir(file)


def rss_bytes() -> int:
    """Resident anonymous bytes after handing freed heap pages back (earlier tests in this process may have raised
    glibc's mmap threshold, so a freed buffer can sit in the heap as memory the process keeps but no longer uses).
    Anonymous only: tensors are anonymous memory, while the code pages a first use maps in (file-backed) depend on
    the CPU and the page cache."""
    trim_heap()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_swap_out_really_frees_memory(swapper):
    nbytes = 200 * 10**6
    tensor = torch.ones(nbytes // 4)
    gc.collect()
    resident = rss_bytes()
    swapper.swap_out({"big": {"t": tensor}}).wait()
    del tensor
    gc.collect()
    freed = resident - rss_bytes()
    assert freed > 0.9 * nbytes, f"RSS fell by {freed} bytes only"
    read = swapper.swap_in(["big"])
    assert read.wait()["big"]["t"].eq(1).all()
    grown = rss_bytes() - (resident - freed)
    assert grown > 0.9 * nbytes
    read.release()
    del read
    gc.collect()
    assert resident - rss_bytes() > 0.9 * nbytes


def test_run_folders_are_per_run_rank_aware_and_removed(scratch):
    a = TensorSwapper(SwapConfig(folder=str(scratch)), rank=3)
    b = TensorSwapper(SwapConfig(folder=str(scratch)), rank=3)
    assert a.folder != b.folder and os.path.basename(a.folder).startswith("deepoffload-rank3-")
    a.swap_out({"g": {"t": torch.ones(3)}}).wait()
    b.swap_out({"g": {"t": torch.zeros(3)}}).wait()
    read = a.swap_in(["g"])
    assert read.wait()["g"]["t"].eq(1).all()
    read.release()
    a.close()
    b.close()
    assert not os.path.exists(a.folder) and not os.path.exists(b.folder)
    kept = TensorSwapper(SwapConfig(folder=str(scratch), keep_files=True))
    kept.swap_out({"g": {"t": torch.ones(3)}}).wait()
    kept.close()
    assert sorted(os.listdir(kept.folder)) == [".deepoffload-run", "KEPT", "g.swp"]  # KEPT: later runs leave it alone
    with pytest.raises(ValueError, match="closed"):
        kept.swap_in(["g"])


def test_files_removed_at_interpreter_exit(scratch):
    import subprocess
    import sys

    code = (
        "import torch; from deepoffload.swap.tensor_swapper import TensorSwapper;"
        "from deepoffload.swap.config import SwapConfig;"
        f"s = TensorSwapper(SwapConfig(folder={str(scratch)!r}));"
        "s.swap_out({'g': {'t': torch.ones(3)}}).wait(); print(s.folder)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    folder = out.stdout.strip()
    assert folder.startswith(str(scratch)) and not os.path.exists(folder)


def test_unwritable_base_folder_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot create a swap folder"):
        TensorSwapper(SwapConfig(folder=str(blocker / "sub")))
