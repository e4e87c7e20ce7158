"""deepoffload.formats: safetensors and torch.save checkpoints read and written through the async-IO op, checked
byte for byte against the safetensors library's own reader and writer."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

safetensors_torch = pytest.importorskip("safetensors.torch")

import deepoffload  # noqa: E402
from deepoffload.formats import (  # noqa: E402
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReader,
    load_file,
    save_file,
    save_sharded,
)
from deepoffload.formats.header import DTYPE_NAMES, DTYPES, PACKED, encode_header, read_header  # noqa: E402
from deepoffload.io.handle import AsyncIOHandle  # noqa: E402


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes of every bit pattern (NaNs included) for float types; 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (NaN payloads included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def assert_same(got: dict, want: dict) -> None:
    assert list(sorted(got)) == list(sorted(want))
    bad = [k for k in want if not same_bytes(got[k], want[k])]
    assert not bad, f"differ: {bad}"


ALL_DTYPES = sorted(DTYPES.values(), key=str)
# Awkward layouts: scalars, empty tensors, and sizes that leave later tensors at odd offsets.
SHAPES = [(), (0,), (3, 0, 2), (1,), (3,), (7, 5), (129, 33)]


def shapes(dtype: torch.dtype) -> list[tuple[int, ...]]:
    """SHAPES, less the scalar for a packed dtype (F4: safetensors cannot record a 0-dim one)."""
    return [shape for shape in SHAPES if shape or dtype not in PACKED]


def raw_header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    tensors = {}
    for i, dtype in enumerate(ALL_DTYPES):
        for j, shape in enumerate(shapes(dtype)):
            tensors[f"t.{str(dtype).split('.')[-1]}.{j}"] = random_tensor(shape, dtype, seed + i * 100 + j)
    return tensors


# -- reading what safetensors wrote ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_reads_each_dtype_bit_identical_to_safetensors(scratch, dtype):
    tensors = {f"x{j}": random_tensor(shape, dtype, j) for j, shape in enumerate(shapes(dtype))}
    path = scratch / "one.safetensors"
    safetensors_torch.save_file(tensors, path)
    assert_same(load_file(path), safetensors_torch.load_file(path))
    assert_same(load_file(path), tensors)


def test_every_dtype_safetensors_writes_is_ours_too(scratch):
    """Each torch dtype that safetensors' own writer saves (asked of it, dtype by dtype) is in DTYPES."""
    written = set()
    for dtype in {d for d in vars(torch).values() if isinstance(d, torch.dtype)}:
        try:
            safetensors_torch.save_file({"x": torch.zeros(2, 4, dtype=torch.uint8).view(dtype)}, scratch / "probe")
        except Exception:  # noqa: BLE001 -- a dtype safetensors refuses, or one whose bytes cannot be viewed so
            continue
        written.add(dtype)
    assert written <= set(DTYPE_NAMES), written - set(DTYPE_NAMES)
    assert {getattr(torch, "float8_e8m0fnu", None), getattr(torch, "float4_e2m1fn_x2", None)} - {None} <= written


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_writes_each_dtype_as_safetensors_does(scratch, dtype):
    """save_file and save_sharded write the entries safetensors writes (dtype name, shape, offsets; F4's shape
    counts 4-bit values), and safetensors reads back the same bits."""
    tensors = {f"x{j}": random_tensor(shape, dtype, j) for j, shape in enumerate(shapes(dtype))}
    safetensors_torch.save_file(tensors, scratch / "theirs.safetensors")
    save_file(tensors, scratch / "ours.safetensors")
    (shard,) = save_sharded(tensors, scratch / "sharded")
    theirs = raw_header(scratch / "theirs.safetensors")
    for path in (scratch / "ours.safetensors", shard):
        ours = raw_header(path)
        assert ours.pop("__metadata__") == {"format": "pt"} and ours == theirs
        assert_same(safetensors_torch.load_file(path), tensors)
        assert_same(load_file(path), tensors)
        assert_same(deepoffload.load(path), tensors)  # a .safetensors path loads through the same reader


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float4_e2m1fn_x2], ids=str)
def test_split_shards_and_torch_save_files_round_trip_the_newest_dtypes(scratch, dtype):
    """F8_E8M0 and F4 split over many shards (max_shard_bytes below one tensor's bytes, so a shard per tensor, and
    between, so several per shard): the index and each shard as safetensors reads them, load_file of the folder,
    and deepoffload.save/load (with torch.load reading ours and ours reading torch.save's), views included."""
    tensors = {f"x{j}": random_tensor((3 + j, 6), dtype, j) for j in range(6)}
    for max_shard_bytes in (8, 60, 1 << 20):
        folder = scratch / f"sharded{max_shard_bytes}"
        files = save_sharded(tensors, folder, max_shard_bytes=max_shard_bytes)
        shards = [f for f in files if f.suffix == ".safetensors"]
        assert len(shards) == {8: 6, 60: 5, 1 << 20: 1}[max_shard_bytes]  # 18..48 bytes: x0 and x1 share one
        theirs = {}
        for shard in shards:
            theirs.update(safetensors_torch.load_file(shard))
        assert_same(theirs, tensors)
        assert_same(load_file(folder), tensors)
    views = {"row": tensors["x5"][1:4], "transposed": tensors["x2"].t(), **tensors}
    deepoffload.save(views, scratch / "ours.pt")
    torch.save(views, scratch / "torch.pt")
    ours, theirs = scratch / "ours.pt", scratch / "torch.pt"
    for got in (deepoffload.load(ours), torch.load(ours), deepoffload.load(theirs)):
        assert_same(got, views)
        assert got["transposed"].stride() == views["transposed"].stride()


def test_reads_mixed_file_with_odd_offsets(scratch):
    tensors = mixed_tensors()
    path = scratch / "mixed.safetensors"
    save_file(tensors, path)  # keeps the given order: many tensors start at offsets their dtype does not divide
    assert_same(load_file(path), tensors)
    assert_same(safetensors_torch.load_file(path), tensors)


def test_reads_hf_sharded_folder_written_by_transformers(scratch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(scratch / "hf", max_shard_size="100KB")
    assert (scratch / "hf" / "model.safetensors.index.json").is_file()
    with CheckpointReader(scratch / "hf") as reader:
        assert reader.format == "safetensors-sharded"
        loaded = reader.read()
    state = model.state_dict()
    assert_same({k: loaded[k] for k in state if k in loaded}, {k: v for k, v in state.items() if k in loaded})
    assert set(state) - set(loaded) <= {"lm_head.weight"}  # a tied head is saved once


# -- writing what safetensors and transformers read --------------------------------------------------------------
def test_sharded_round_trip_against_safetensors(scratch):
    tensors = mixed_tensors(seed=5)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    paths = save_sharded(iter(tensors.items()), scratch / "ck", max_shard_bytes=total // 4)
    count = len(paths)
    assert count >= 4
    index = json.loads((scratch / "ck" / "model.safetensors.index.json").read_text())
    generation = index["metadata"]["generation"]
    assert [p.name for p in paths] == [
        f"model-{i:05d}-of-{count:05d}-{generation}.safetensors" for i in range(1, count + 1)
    ]
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(tensors)
    reference = {}
    for path in paths:
        part = safetensors_torch.load_file(path)
        assert all(index["weight_map"][k] == path.name for k in part)
        reference.update(part)
    assert_same(reference, tensors)
    assert_same(load_file(scratch / "ck"), tensors)
    assert sorted(os.listdir(scratch / "ck")) == sorted([p.name for p in paths] + ["model.safetensors.index.json"])


def test_shard_size_limit_and_oversized_tensor(scratch):
    tensors = {"a": torch.zeros(100), "big": torch.ones(1000), "b": torch.zeros(100), "c": torch.zeros(100)}
    paths = save_sharded(tensors, scratch, max_shard_bytes=900)
    parts = [list(safetensors_torch.load_file(p)) for p in paths]
    assert parts == [["a"], ["big"], ["b", "c"]]


def test_single_shard_has_no_index_and_replaces_an_earlier_save(scratch):
    first = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}
    save_sharded(first, scratch, max_shard_bytes=1024)
    assert (scratch / "model.safetensors.index.json").exists()
    second = {"only": torch.arange(10.0)}
    paths = save_sharded(second, scratch)
    assert [p.name for p in paths] == ["model.safetensors"]
    assert sorted(os.listdir(scratch)) == ["model.safetensors"]  # stale shards and index removed
    assert_same(load_file(scratch), second)
    assert safetensors_torch.safe_open(paths[0], "pt").metadata() == {"format": "pt"}


def test_header_reservation_overflow_starts_new_shards(scratch):
    tensors = {f"layer.{i}." + "x" * 200: torch.full((3,), float(i)) for i in range(60)}
    paths = save_sharded(tensors, scratch, header_bytes=4096)
    assert len(paths) > 1  # 60 entries of ~280 bytes do not fit one 4 KiB header
    assert_same(load_file(scratch), tensors)
    for path in paths:
        safetensors_torch.load_file(path)
    huge_name = {"n" * 10000: torch.zeros(2)}  # one entry larger than the reservation: it grows
    save_sharded(huge_name, scratch / "huge", header_bytes=4096)
    assert_same(load_file(scratch / "huge"), huge_name)


def test_empty_save_and_empty_tensors(scratch):
    save_sharded({}, scratch / "none")
    assert load_file(scratch / "none") == {}
    assert safetensors_torch.load_file(scratch / "none" / "model.safetensors") == {}
    empties = {"e": torch.empty(0), "s": torch.tensor(3.5), "z": torch.empty(2, 0, dtype=torch.int64)}
    save_sharded(empties, scratch / "empties")
    assert_same(load_file(scratch / "empties"), empties)
    assert_same(safetensors_torch.load_file(scratch / "empties" / "model.safetensors"), empties)


def test_transformers_from_pretrained_reads_our_shards(scratch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    config.save_pretrained(scratch)
    state = model.state_dict()
    save_sharded(((k, v) for k, v in state.items()), scratch, max_shard_bytes=40_000)
    assert (scratch / "model.safetensors.index.json").is_file()
    loaded = transformers.LlamaForCausalLM.from_pretrained(scratch)
    assert_same(loaded.state_dict(), state)


def test_streams_from_a_generator_one_tensor_at_a_time(scratch):
    produced = []

    def blocks():
        for i in range(6):
            t = torch.full((1 << 16,), float(i))
            produced.append(i)
            yield f"b{i}", t

    save_sharded(blocks(), scratch, max_shard_bytes=3 << 18, staging_bytes=1 << 16)
    assert produced == list(range(6))
    assert_same(load_file(scratch), {f"b{i}": torch.full((1 << 16,), float(i)) for i in range(6)})


# -- writer errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, message",
    [
        ({"m": torch.empty(3, device="meta")}, "meta device"),
        ({"c": torch.zeros(2, dtype=torch.complex128)}, "no dtype"),
        ({"__metadata__": torch.zeros(2)}, "other than"),
        *([({"s": torch.zeros((), dtype=torch.uint8).view(packed)}, r"0-dim .*reshape\(1\)") for packed in PACKED]),
    ],
)
def test_writer_refuses_bad_tensors_and_leaves_no_file(scratch, bad, message):
    save_sharded({"keep": torch.ones(4)}, scratch)
    before = sorted(os.listdir(scratch))
    with pytest.raises(ValueError, match=message):
        save_sharded({"first": torch.zeros(10), **bad}, scratch)
    assert sorted(os.listdir(scratch)) == before
    assert_same(load_file(scratch), {"keep": torch.ones(4)})


def test_writer_failing_iterator_leaves_the_earlier_save(scratch):
    save_sharded({"keep": torch.ones(4)}, scratch)

    def failing():
        yield "a", torch.zeros(1 << 18)
        yield "b", torch.zeros(1 << 18)
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError, match="producer failed"):
        save_sharded(failing(), scratch, max_shard_bytes=1 << 20)
    assert sorted(os.listdir(scratch)) == ["model.safetensors"]
    assert_same(load_file(scratch), {"keep": torch.ones(4)})
    with pytest.raises(ValueError, match="twice"):
        save_sharded([("a", torch.zeros(1)), ("a", torch.zeros(1))], scratch)


# -- reading subsets, lazily -------------------------------------------------------------------------------------
class CountingHandle(AsyncIOHandle):
    def __init__(self):
        super().__init__()
        self.read_bytes = 0

    def read_async(self, tensor, file, offset=0):
        self.read_bytes += tensor.numel() * tensor.element_size()
        return super().read_async(tensor, file, offset)


def test_reads_only_the_requested_block(scratch):
    blocks = {
        f"layers.{b}.{w}": random_tensor((256, 256), torch.float32, b * 10 + i)
        for b in range(4)
        for i, w in enumerate(("q", "k", "v"))
    }
    save_sharded(blocks, scratch, max_shard_bytes=1 << 20)
    with (
        CountingHandle() as handle,
        CheckpointReader(scratch, handle=handle, span_bytes=1 << 20, gap_bytes=0) as reader,
    ):
        names = [n for n in reader.names() if n.startswith("layers.2.")]
        got = reader.read(names)
        assert_same(got, {n: blocks[n] for n in names})
        block_bytes = 3 * 256 * 256 * 4
        assert block_bytes <= handle.read_bytes <= block_bytes + 2 * 4096 * 3
        generator = reader.iter_tensors()
        name, first = next(generator)  # reading ahead is bounded by inflight_bytes (default 256 MiB: all here)
        assert same_bytes(first, blocks[name])
        generator.close()


def test_read_ahead_bounded_and_spans_split(scratch):
    tensors = {f"w{i}": random_tensor((1 << 14,), torch.float32, i) for i in range(16)}  # 64 KiB each
    save_file(tensors, scratch / "m.safetensors")
    with (
        CountingHandle() as handle,
        CheckpointReader(
            scratch / "m.safetensors", handle=handle, span_bytes=128 << 10, inflight_bytes=256 << 10
        ) as reader,
    ):
        generator = reader.iter_tensors()
        next(generator)
        assert handle.read_bytes <= (256 << 10) + 8192  # two spans of two tensors, not the whole file
        rest = dict(generator)
        assert len(rest) == 15
        assert_same({"w0": tensors["w0"], **rest}, tensors)


@pytest.mark.parametrize("slow", [False, True])
def test_span_buffers_faulted_in_by_two_threads_when_faulting_is_slow(scratch, monkeypatch, slow):
    """Once a span buffer faults in slower than SLOW_FAULT_BYTES_PER_S, the next ones are faulted in by two threads
    writing zeros before their reads: the tensors read are bit-identical either way."""
    from deepoffload.formats import fault_in as fault_module
    from deepoffload.formats import reader as reader_module

    monkeypatch.setattr(reader_module, "FAULT_SPLIT_PAGES", 2)  # when the reader times faulting in
    monkeypatch.setattr(fault_module, "FAULT_SPLIT_PAGES", 2)  # when _fault_in splits the work
    monkeypatch.setattr(reader_module, "SLOW_FAULT_BYTES_PER_S", float("inf") if slow else 0.0)
    tensors = {f"w{i}": random_tensor((1 << 14,), torch.float32, i) for i in range(16)}  # 64 KiB each
    save_file(tensors, scratch / "m.safetensors")
    workers = []
    real_thread = fault_module.threading.Thread
    monkeypatch.setattr(fault_module.threading, "Thread", lambda *a, **k: workers.append(k) or real_thread(*a, **k))
    with CheckpointReader(scratch / "m.safetensors", span_bytes=128 << 10, inflight_bytes=256 << 10) as reader:
        assert_same(reader.read(), tensors)
        assert reader._fault_threads == (2 if slow else 1)
    assert len(workers) == (7 if slow else 0)  # 8 spans: the first is faulted in by one thread, then it was slow


def test_dtype_conversion(scratch):
    tensors = {"f": random_tensor((8,), torch.float32), "i": torch.arange(8), "h": torch.randn(4).half()}
    save_file(tensors, scratch / "m.safetensors")
    got = load_file(scratch / "m.safetensors", dtype=torch.bfloat16)
    assert got["f"].dtype == got["h"].dtype == torch.bfloat16 and got["i"].dtype == torch.int64
    assert torch.equal(got["f"], tensors["f"].bfloat16())
    got = load_file(scratch / "m.safetensors", dtype={"h": torch.float32})
    assert got["h"].dtype == torch.float32 and got["f"].dtype == torch.float32
    with pytest.raises(CheckpointError, match="'i'.*not be exact"):
        load_file(scratch / "m.safetensors", dtype={"i": torch.float32})


def test_check_against_expected_names_and_shapes(scratch):
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4), "extra": torch.zeros(1)}, scratch / "m.safetensors")
    with torch.device("meta"):
        expected = {"a": torch.empty(2, 3), "b": torch.empty(4), "gone": torch.empty(1)}
    with CheckpointReader(scratch / "m.safetensors") as reader:
        with pytest.raises(CheckpointError, match=r"1 missing: \['gone'\].*1 unexpected: \['extra'\].*strict=False"):
            reader.check(expected)
        assert reader.check(expected, strict=False) == (["gone"], ["extra"])
        with pytest.raises(CheckpointError, match=r"a: checkpoint \[2, 3\], expected \[3, 2\]"):
            reader.check({"a": (3, 2), "b": (4,)}, strict=False)
        with pytest.raises(CheckpointError, match="b: checkpoint torch.float32 cannot become torch.int64"):
            reader.check({"a": ((2, 3), torch.bfloat16), "b": ((4,), torch.int64)}, strict=False)
        with pytest.raises(CheckpointError, match="no tensors named"):
            reader.read(["nope"])
    with pytest.raises(CheckpointError, match="missing"):
        load_file(scratch / "m.safetensors", expected=expected)


def test_torch_save_state_dict(scratch):
    tensors = mixed_tensors(seed=9)
    torch.save(tensors, scratch / "sd.pt")
    with CheckpointReader(scratch / "sd.pt") as reader:
        assert reader.format == "torch"
        assert_same(reader.read(), tensors)
        assert reader.shape_dtype("t.float32.5") == ((7, 5), torch.float32)
    torch.save({"nested": {"a": torch.zeros(1)}}, scratch / "nested.pt")
    with pytest.raises(CheckpointError, match="flat dict"):
        CheckpointReader(scratch / "nested.pt")
    torch.save({"a": torch.zeros(1)}, scratch / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="zip format"):
        CheckpointReader(scratch / "legacy.pt")


def test_big_endian_host_refused(scratch, monkeypatch):
    save_file({"a": torch.zeros(1)}, scratch / "m.safetensors")
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(RuntimeError, match="little-endian"):
        CheckpointReader(scratch / "m.safetensors")
    with pytest.raises(RuntimeError, match="little-endian"):
        save_sharded({"a": torch.zeros(1)}, scratch / "out")


# -- malformed files and indexes -----------------------------------------------------------------------------------
def raw_file(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header, data, length, message",
    [
        ({"a": F32_2}, b"\0" * 8, 10**9, "exceeds the limit"),
        ({"a": F32_2}, b"\0" * 8, 5000, "past the end"),
        (b"[1, 2]", b"", None, "JSON object"),
        (b"{not json", b"", None, "JSON object"),
        (
            b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": {"dtype": "F32", "shape": [0], '
            b'"data_offsets": [0, 0]}}',
            b"",
            None,
            "duplicate key",
        ),
        (b"\xff\xfe", b"", None, "JSON object"),
        ({"a": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "dtype 'F99' is unknown"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "takes 12 bytes"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "non-negative"),
        ({"a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "non-negative"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, "begin <= end"),
        ({"a": F32_2}, b"\0" * 4, None, "run past"),
        ({"a": F32_2}, b"\0" * 12, None, "trailing"),
        ({"a": F32_2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlap"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "belong to no tensor"),
        ({"a": {**F32_2, "extra": 1}}, b"\0" * 8, None, "exactly the keys"),
        ({"__metadata__": {"k": 1}, "a": F32_2}, b"\0" * 8, None, "object of strings"),
    ],
)
def test_malformed_headers_are_clear_errors(scratch, header, data, length, message):
    path = raw_file(scratch / "bad.safetensors", header, data, length)
    with pytest.raises(CheckpointError, match=message) as info:
        CheckpointReader(path)
    assert str(path) in str(info.value)


@pytest.mark.skipif("F4" not in DTYPES, reason="this torch has no float4_e2m1fn_x2")
@pytest.mark.parametrize(
    "shape, nbytes, message",
    [([3], 2, "byte boundary"), ([], 0, "byte boundary"), ([2, 3], 3, "multiple of 2"), ([0, 3], 0, "multiple of 2")],
)
def test_f4_shapes_torch_cannot_hold_are_refused_as_safetensors_refuses_them(scratch, shape, nbytes, message):
    path = raw_file(scratch / "f4.safetensors", {"a": {"dtype": "F4", "shape": shape, "data_offsets": [0, nbytes]}})
    path.write_bytes(path.read_bytes() + b"\x11" * nbytes)
    with pytest.raises(CheckpointError, match=message):
        load_file(path)
    with pytest.raises(Exception, match="byte boundary|divisible by 2"):
        safetensors_torch.load_file(path)


def test_short_file_and_missing_file(scratch):
    (scratch / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="shorter than the 8-byte"):
        load_file(scratch / "short.safetensors")
    (scratch / "empty_folder").mkdir()
    for missing, message in [
        (scratch / "absent.safetensors", "no such checkpoint"),
        (scratch / "empty_folder", "no model.safetensors.index.json or model.safetensors"),
    ]:
        # what safetensors and torch.load raise for a missing file, so the except clauses around them catch it
        with pytest.raises(FileNotFoundError, match=message) as info:
            load_file(missing)
        assert isinstance(info.value, CheckpointNotFoundError) and isinstance(info.value, CheckpointError)
        assert info.value.errno == errno.ENOENT and info.value.filename == str(missing)
    with pytest.raises(FileNotFoundError, match="no such safetensors file") as info:
        read_header(scratch / "absent.safetensors")
    assert info.value.errno == errno.ENOENT and info.value.filename == str(scratch / "absent.safetensors")


def test_index_problems(scratch):
    tensors = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}
    save_sharded(tensors, scratch, max_shard_bytes=1024)
    index_path = scratch / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    second = index["weight_map"]["w1"]
    os.rename(scratch / second, scratch / "moved")
    with pytest.raises(CheckpointNotFoundError, match=f"shard {second} of .* is missing") as info:
        CheckpointReader(scratch)
    assert info.value.errno == errno.ENOENT and info.value.filename == str(scratch / second)
    os.rename(scratch / "moved", scratch / second)
    wrong = dict(index, weight_map={**index["weight_map"], "w0": second})
    index_path.write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match="disagree"):
        CheckpointReader(scratch)
    index_path.write_text(json.dumps(dict(index, weight_map={"w0": "../model-00001-of-00004.safetensors"})))
    with pytest.raises(CheckpointError, match="not a file name"):
        CheckpointReader(index_path)
    index_path.write_text("{]")
    with pytest.raises(CheckpointError, match="cannot read the safetensors index"):
        CheckpointReader(scratch)
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        CheckpointReader(scratch)


def test_save_file_refuses_bad_input_as_save_sharded_does(scratch):
    # save_file wrote metadata {"k": 1} as "1" (save_sharded refuses it), raised AttributeError('numel') for a
    # non-tensor, and named only its temporary file when the folder was missing
    with pytest.raises(ValueError, match="metadata must map strings to strings"):
        save_file({"a": torch.ones(2)}, scratch / "m.safetensors", metadata={"step": 1})
    with pytest.raises(TypeError, match="'a': expected a torch.Tensor, got list"):
        save_file({"a": [1, 2]}, scratch / "l.safetensors")
    with pytest.raises(ValueError, match="'c': safetensors has no dtype for torch.complex128"):  # was a bare KeyError
        save_file({"c": torch.zeros(2, dtype=torch.complex128)}, scratch / "c.safetensors")
    target = scratch / "absent" / "x.safetensors"
    with pytest.raises(FileNotFoundError, match="its folder .* does not exist") as info:
        save_file({"a": torch.ones(2)}, target)
    assert info.value.filename == str(target)
    assert sorted(p.name for p in scratch.iterdir()) == []


@pytest.mark.root
def test_full_and_read_only_disks_name_the_checkpoint_and_keep_the_earlier_save(small_fs):
    # the OSError named only a temporary '.partial' file of the save
    folder = small_fs(8 << 20, "tmpfs")
    old = {"a": torch.full((1000,), 1.0)}
    save_file(old, folder / "x.safetensors")
    save_sharded(old, folder / "sh")
    big = {f"w{i}": torch.randn(1 << 18) for i in range(10)}  # 10 MiB: does not fit
    for save, target in (
        (lambda: save_file(big, folder / "x.safetensors"), folder / "x.safetensors"),
        (lambda: save_sharded(big, folder / "sh", max_shard_bytes=2 << 20), folder / "sh"),
    ):
        with pytest.raises(OSError) as info:
            save()
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(target), info.value
        assert f"cannot save {target}: " in str(info.value)
    assert sorted(os.listdir(folder)) == ["sh", "x.safetensors"] and os.listdir(folder / "sh") == ["model.safetensors"]
    assert_same(load_file(folder / "x.safetensors"), old)
    assert_same(load_file(folder / "sh"), old)
    read_only = small_fs(1 << 20, "tmpfs", read_only=True)
    with pytest.raises(OSError) as info:
        save_file(old, read_only / "y.safetensors")
    assert info.value.errno == errno.EROFS and info.value.filename == str(read_only / "y.safetensors")


def test_a_file_replaced_after_open_is_refused_not_read_at_the_old_offsets(scratch):
    # The op reads by path: a save renamed over the file (same size, tensors in another order) was read at the old
    # header's offsets, returning the other tensor's values under the wrong name.
    path = scratch / "model.safetensors"
    save_file({"a": torch.zeros(1024), "b": torch.ones(1024)}, path)
    reader = CheckpointReader(path)
    save_file({"b": torch.full((1024,), 7.0), "a": torch.full((1024,), 5.0)}, path)
    with pytest.raises(CheckpointError, match="replaced or rewritten after this reader read its header"):
        reader.read()
    with pytest.raises(CheckpointError, match="replaced or rewritten"):
        reader.read_into({"a": torch.empty(1024)})
    folder = scratch / "sharded"
    save_sharded({f"w{i}": torch.full((256,), float(i)) for i in range(4)}, folder, max_shard_bytes=1024)
    sharded = CheckpointReader(folder)
    third = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]["w2"]
    (folder / third).unlink()
    assert torch.equal(sharded.read(["w0"])["w0"], torch.zeros(256))  # the other shards are still what was opened
    with pytest.raises(CheckpointError, match=f"{third} was removed after"):
        sharded.read()
    assert torch.equal(CheckpointReader(path).read()["a"], torch.full((1024,), 5.0))


def test_a_torch_save_file_rewritten_in_place_after_open_is_refused_not_served(scratch):
    # torch.save to the same path rewrites the file in place: the reader's mapping served the new values under the
    # opened names, and once the file was shorter, touching the mapping killed the process (SIGBUS): so in a child
    child = f"""
import torch
from deepoffload.formats import CheckpointError, CheckpointReader
path = {str(scratch / "model.pt")!r}
for shorter in (False, True):
    torch.save({{"a": torch.zeros(1 << 16), "b": torch.ones(1 << 16)}}, path)
    reader = CheckpointReader(path)
    held = reader.read(["a"])["a"]
    torch.save({{"x": torch.ones(3)}} if shorter else {{"a": torch.full((1 << 16,), 5.0), "b": torch.zeros(1 << 16)}},
               path)
    for read in (lambda: reader.read(), lambda: reader.read_into({{"b": torch.empty(1 << 16)}}),
                 lambda: next(reader.iter_tensors(["b"], dtype=torch.float16))):
        try:
            read()
            raise SystemExit("read after the rewrite")
        except CheckpointError as e:
            if "replaced or rewritten after this reader read its header" not in str(e):
                raise
    if not torch.equal(held, torch.zeros(1 << 16)):
        raise SystemExit("a tensor read before the rewrite changed with the file")
print("refused")
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "refused", (done.returncode, done.stderr[-2000:])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_headers_never_read_wrong(scratch, data):
    """Any mutation of a valid file either is refused with CheckpointError or reads exactly what safetensors
    reads."""
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1, 2], dtype=torch.int16),
        "c": torch.tensor(True),
    }
    layout, position = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        layout[name] = (t.dtype, tuple(t.shape), position, position + n)
        position += n
    raw = bytearray(
        encode_header(layout, {"format": "pt"})
        + b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    )
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[at] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del raw[at : at + data.draw(st.integers(1, 8))]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        if len(raw) < 2:
            break
    path = scratch / "fuzz.safetensors"
    path.write_bytes(bytes(raw))
    try:
        ours = load_file(path)
    except CheckpointError:
        return
    assert_same(ours, safetensors_torch.load_file(path))


def test_read_into_reuses_its_buffers_block_after_block(scratch, monkeypatch):
    from deepoffload.formats import reader as reader_module

    blocks = {
        f"layers.{b}.{w}": random_tensor((300, 257), torch.float32, b * 10 + i)
        for b in range(4)
        for i, w in enumerate(("q", "k"))
    }
    blocks["odd"] = random_tensor((3,), torch.int8)  # leaves the next tensors at offsets floats do not divide
    blocks.update({f"layers.4.{w}": random_tensor((5, 7), torch.float32, 99 + i) for i, w in enumerate("qk")})
    save_file(blocks, scratch / "m.safetensors")
    allocations = []
    real = reader_module.aligned_empty
    monkeypatch.setattr(reader_module, "aligned_empty", lambda *a, **k: allocations.append(a) or real(*a, **k))
    with CheckpointReader(scratch / "m.safetensors", span_bytes=1 << 20, inflight_bytes=1 << 20) as reader:
        for b in range(5):
            names = [n for n in blocks if n.startswith(f"layers.{b}.")]
            out = {n: torch.empty(blocks[n].shape, dtype=torch.float32) for n in names}
            reader.read_into(out)
            assert_same(out, {n: blocks[n] for n in names})
            if b == 0:
                after_first = len(allocations)
        assert len(allocations) == after_first  # later blocks reuse the first block's buffers
        half = {"layers.0.q": torch.empty(300, 257, dtype=torch.bfloat16)}
        reader.read_into(half)
        assert same_bytes(half["layers.0.q"], blocks["layers.0.q"].bfloat16())
        with pytest.raises(CheckpointError, match=r"layers.0.k: checkpoint \[300, 257\], destination \[257, 300\]"):
            reader.read_into({"layers.0.k": torch.empty(257, 300)})
        with pytest.raises(CheckpointError, match="odd: checkpoint torch.int8 cannot become torch.float32"):
            reader.read_into({"odd": torch.empty(3)})
        with pytest.raises(CheckpointError, match="nope: not in the checkpoint"):
            reader.read_into({"nope": torch.empty(3)})
    torch.save(blocks, scratch / "m.pt")
    with CheckpointReader(scratch / "m.pt") as reader:
        out = {"layers.3.k": torch.empty(300, 257)}
        reader.read_into(out)
        assert_same(out, {"layers.3.k": blocks["layers.3.k"]})


@pytest.mark.parametrize("misaligned", [False, True])
def test_read_into_fills_tensors_larger_than_a_span_through_its_buffers(scratch, monkeypatch, misaligned):
    """A tensor larger than span_bytes is read piece by piece through the reused span buffers (no buffer of its
    size), bit-identical, with dtype conversion, also where it starts between whole elements of the file."""
    from deepoffload.formats import reader as reader_module

    tensors = {"a.small": random_tensor((1000,), torch.float32, 1)}
    if misaligned:
        tensors["a.odd"] = random_tensor((3,), torch.int8)  # the next tensors start at offsets floats do not divide
    tensors.update(
        {
            "b.big": random_tensor((700, 301), torch.float32, 2),  # 842,800 bytes: 6.4 spans of 128 KiB
            "c.big16": random_tensor((150_001,), torch.bfloat16, 3),
            "d.tail": random_tensor((5,), torch.float32, 4),
        }
    )
    save_file(tensors, scratch / "m.safetensors")
    span = 128 << 10
    allocations = []
    real = reader_module.aligned_empty
    monkeypatch.setattr(reader_module, "aligned_empty", lambda *a, **k: allocations.append(a[0]) or real(*a, **k))
    with (
        CountingHandle() as handle,
        CheckpointReader(scratch / "m.safetensors", handle=handle, span_bytes=span, inflight_bytes=2 * span) as reader,
    ):
        out = {n: torch.full(t.shape, -1, dtype=t.dtype) for n, t in tensors.items() if n != "a.odd"}
        reader.read_into(out)
        assert_same(out, {n: tensors[n] for n in out})
        assert allocations and max(allocations) <= span + 2 * 4096  # no buffer of a whole big tensor
        if not misaligned:  # pieces end on the read alignment: nothing read twice
            assert handle.read_bytes <= sum(t.numel() * t.element_size() for t in tensors.values()) + 4 * 4096
        wide = {"b.big": torch.empty(700, 301, dtype=torch.float64), "c.big16": torch.empty(150_001)}
        reader.read_into(wide)  # converted piece by piece
        assert same_bytes(wide["b.big"], tensors["b.big"].double())  # (random bits: NaNs compared by their bytes)
        assert same_bytes(wide["c.big16"], tensors["c.big16"].float())
        transposed = torch.empty(301, 700).t()  # not contiguous: read whole, still right
        reader.read_into({"b.big": transposed})
        assert same_bytes(transposed.contiguous(), tensors["b.big"])


def test_public_names_resolve_and_import_is_cheap():
    import subprocess

    import deepoffload.formats as formats

    for name in formats.__all__:
        assert getattr(formats, name) is not None, name
    code = "import sys, deepoffload.formats; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == [
        "False"
    ]
