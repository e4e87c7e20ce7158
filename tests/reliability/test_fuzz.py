"""Bad input, fuzzed (hypothesis): random sizes, file offsets, dtypes, buffer alignments, engines and settings
round-trip exactly; bad arguments, out-of-range settings and random config dicts fail with a clear Python
exception (ValueError/TypeError/OSError, a message that names the problem), never a crash. Default example counts
are small so the suite stays fast; the ``slow`` variants run many more."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepoffload import AioConfig, AsyncIOHandle, aligned_empty
from deepoffload.config import ALIASES, ConfigError

DTYPES = [
    torch.uint8,
    torch.int8,
    torch.bool,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.int32,
    torch.float64,
    torch.int64,
    torch.complex64,
    torch.complex128,
]
MAX_BYTES = 3 << 20
QUICK = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
THOROUGH = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Sizes and offsets near the boundaries that matter (page, block, shard cuts) as well as anywhere.
near_pages = st.builds(
    lambda pages, delta: max(0, pages * 4096 + delta), st.integers(0, MAX_BYTES // 4096), st.integers(-3, 3)
)
byte_counts = st.one_of(st.integers(0, 64), near_pages, st.integers(0, MAX_BYTES))
offsets = st.one_of(st.just(0), near_pages.filter(lambda n: n <= 1 << 20), st.integers(0, 1 << 20))

settings_strategy = st.fixed_dictionaries(
    {
        "block_size": st.one_of(st.sampled_from([4096, 4097, 65536, 1 << 20]), st.integers(4096, 4 << 20)),
        "queue_depth": st.integers(1, 64),
        "intra_op_parallelism": st.integers(1, 6),
        "single_submit": st.booleans(),
        "overlap_events": st.booleans(),
    }
)


@st.composite
def transfers(draw):
    dtype = draw(st.sampled_from(DTYPES))
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = draw(byte_counts) // itemsize
    return {
        "dtype": dtype,
        "numel": numel,
        "offset": draw(offsets),
        "buffer": draw(st.sampled_from(["pinned", "aligned", "unaligned", "plain"])),
        "prefix": draw(st.sampled_from(["none", "shorter", "longer"])),  # what the file holds before
        "truncate": draw(st.sampled_from([None, True, False])),
        "seed": draw(st.integers(0, 2**31)),
    }


def make_tensor(kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if kind == "pinned":
        return aligned_empty(numel, dtype)
    if kind == "aligned":
        return aligned_empty(numel, dtype, pin=False)
    if kind == "unaligned":
        return torch.empty(numel + 1, dtype=dtype)[1:]  # one element past an aligned start
    return torch.empty(numel, dtype=dtype)


def random_tensor(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    raw = torch.randint(
        0,
        256,
        (numel * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    if dtype == torch.bool:
        raw = raw & 1  # only 0 and 1 are valid bools
    return raw.view(dtype)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    base = os.environ.get("DEEPOFFLOAD_TEST_DIR")
    return tmp_path_factory.mktemp("fuzz") if not base else Path(tempfile.mkdtemp(dir=base, prefix="fuzz-"))


def check_round_trip(engine: str, config: dict, t: dict, folder) -> None:
    path = folder / f"rt-{engine}"
    nbytes = t["numel"] * torch.empty((), dtype=t["dtype"]).element_size()
    before = {"none": b"", "shorter": os.urandom(t["offset"] // 2), "longer": os.urandom(t["offset"] + nbytes + 5000)}[
        t["prefix"]
    ]
    path.write_bytes(before)
    data = random_tensor(t["numel"], t["dtype"], t["seed"])
    src = make_tensor(t["buffer"], t["numel"], t["dtype"])
    src.copy_(data)
    with AsyncIOHandle(engine=engine, **config) as h:
        assert h.write(src, path, t["offset"], truncate=t["truncate"]) == nbytes
        truncated = t["offset"] == 0 if t["truncate"] is None else t["truncate"]
        end = t["offset"] + nbytes
        expected = before[: t["offset"]].ljust(t["offset"], b"\0") + data.view(torch.uint8).numpy().tobytes()
        if not truncated:
            expected += before[end:]
        if nbytes == 0 and not truncated:  # like pwrite: writing nothing past the end does not extend the file
            expected = before
        assert path.read_bytes() == expected, (
            "the file holds exactly: what was before the offset, the tensor, and (without truncate) what was after it"
        )
        back = make_tensor(t["buffer"], t["numel"], t["dtype"])
        back.view(torch.uint8).fill_(0xA5)
        assert h.read(back, path, t["offset"]) == nbytes
    assert torch.equal(back.view(torch.uint8), data.view(torch.uint8)), (engine, config, t)


@QUICK
@given(data=st.data(), config=settings_strategy, t=transfers())
def test_random_transfers_round_trip_exactly(engines, fuzz_dir, data, config, t):
    check_round_trip(data.draw(st.sampled_from(engines)), config, t, fuzz_dir)


@pytest.mark.slow
@THOROUGH
@given(data=st.data(), config=settings_strategy, t=transfers())
def test_many_random_transfers_round_trip_exactly(engines, fuzz_dir, data, config, t):
    check_round_trip(data.draw(st.sampled_from(engines)), config, t, fuzz_dir)


BAD_CALLS = {
    "negative offset": (lambda h, d: h.write(torch.empty(4), d / "x", -1), ValueError, "offset"),
    "float offset": (lambda h, d: h.write(torch.empty(4), d / "x", 1.5), ValueError, "offset"),
    "bool offset": (lambda h, d: h.write(torch.empty(4), d / "x", True), ValueError, "offset"),
    "offset past 2**63": (lambda h, d: h.write(torch.empty(4), d / "x", 2**63), ValueError, "offset"),
    "offset + bytes past 2**63": (lambda h, d: h.read(torch.empty(4), d / "x", 2**63 - 8), ValueError, "offset"),
    "huge offset in range": (lambda h, d: h.write(torch.empty(4), d / "x", 2**62), OSError, "offset"),
    "not a tensor": (lambda h, d: h.write([1, 2, 3], d / "x"), TypeError, "torch.Tensor"),
    "numpy array": (lambda h, d: h.read(__import__("numpy").zeros(4), d / "x"), TypeError, "torch.Tensor"),
    "non-contiguous": (lambda h, d: h.write(torch.empty(8, 8).t(), d / "x"), ValueError, "contiguous"),
    "sparse": (lambda h, d: h.write(torch.eye(3).to_sparse(), d / "x"), ValueError, "sparse"),
    "sparse CSR": (lambda h, d: h.read(torch.eye(3).to_sparse_csr(), d / "x"), ValueError, "sparse"),
    "conjugate view": (
        lambda h, d: h.write(torch.ones(4, dtype=torch.complex64).conj(), d / "x"),
        ValueError,
        "resolve_conj",
    ),
    "negative view": (lambda h, d: h.read(torch._neg_view(torch.ones(4)), d / "x"), ValueError, "read into a new"),
    "meta tensor": (lambda h, d: h.write(torch.empty(4, device="meta"), d / "x"), ValueError, "meta"),
    "float file": (lambda h, d: h.write(torch.empty(4), 2.0), TypeError, "path or a file descriptor"),
    "bool file": (lambda h, d: h.write(torch.empty(4), True), TypeError, "bool"),
    "None file": (lambda h, d: h.write(torch.empty(4), None), TypeError, "path or a file descriptor"),
    "empty path": (lambda h, d: h.write(torch.empty(4), ""), ValueError, "path"),
    "negative fd": (lambda h, d: h.write(torch.empty(4), -3), ValueError, "descriptor"),
    "fd past 2**31": (lambda h, d: h.write(torch.empty(4), 2**40), ValueError, "descriptor"),
    "closed fd": (lambda h, d: h.write(torch.empty(4), 987_654), OSError, "fd"),
    "missing folder": (lambda h, d: h.read(torch.empty(4), d / "no" / "x"), FileNotFoundError, "open"),
    "a folder as file": (lambda h, d: h.write(torch.empty(4), d), IsADirectoryError, "open"),
    "past the end": (lambda h, d: h.read(torch.empty(1 << 20), d / "x"), OSError, "read"),
    "NUL in path": (lambda h, d: h.write(torch.empty(4), str(d / "x\0y")), ValueError, "null byte"),
    "NUL in bytes path": (lambda h, d: h.read(torch.empty(4), os.fsencode(d / "x") + b"\0"), ValueError, "null byte"),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_raise_clear_python_errors(handle, scratch, case):
    call, error, words = BAD_CALLS[case]
    (scratch / "x").write_bytes(b"z" * 100)
    with pytest.raises(error, match=words) as info:
        call(handle, scratch)
    assert str(info.value)
    t = torch.arange(1000, dtype=torch.int16)
    handle.write(t, scratch / "after")  # the handle still works
    back = torch.empty_like(t)
    handle.read(back, scratch / "after")
    assert torch.equal(back, t) and handle.pending() == 0


BAD_SETTINGS = (
    [("block_size", v) for v in (0, 1, 4095, (1 << 30) + 1, 2**63, 2**70)]
    + [("queue_depth", v) for v in (0, 32769, 2**31, 2**40)]
    + [("intra_op_parallelism", v) for v in (0, 257, 2**31, 2**64)]
    + [
        ("single_submit", 1),
        ("overlap_events", "yes"),
        ("engine", "fastest"),
        ("block_size", 4096.0),
        ("queue_depth", True),
        ("thread_count", -1),
    ]
)


@pytest.mark.parametrize("key,value", BAD_SETTINGS)
def test_out_of_range_settings_raise_value_errors_naming_the_key(aio, key, value):
    with pytest.raises(
        ValueError, match=ALIASES.get(key, key) if key != "intra_op_parallelism" else "intra_op_parallelism|threads"
    ) as info:
        AsyncIOHandle(**{key: value})
    assert repr(value)[:20] in str(info.value) or str(value)[:20] in str(info.value), str(info.value)


def test_an_engine_that_cannot_start_raises_oserror_with_errno(engines):
    """A resource limit (here libaio's system-wide /proc/sys/fs/aio-max-nr, 65536 by default) is an OSError
    carrying errno and what to do, not a RuntimeError."""
    if "libaio" not in engines:
        pytest.skip("libaio is not usable here")
    with open("/proc/sys/fs/aio-max-nr") as f:
        limit = int(f.read())
    if limit > 32768 * 256:
        pytest.skip(f"aio-max-nr is {limit}: too large to exceed")
    threads = min(256, limit // 32768 + 1)
    with pytest.raises(OSError) as info:
        AsyncIOHandle(engine="libaio", queue_depth=32768, intra_op_parallelism=threads)
    assert info.value.errno and "io_setup" in str(info.value) and "aio-max-nr" in str(info.value)


config_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(), st.integers(), max_size=2),
)
config_keys = st.one_of(st.sampled_from(AioConfig.keys() + tuple(ALIASES)), st.text(max_size=12))


@settings(max_examples=300, deadline=None)
@given(values=st.one_of(st.dictionaries(config_keys, config_values, max_size=6), config_values))
def test_random_config_dicts_give_a_config_or_a_config_error(values):
    try:
        config = AioConfig.from_dict(values, base=AioConfig())
    except ConfigError as e:
        assert str(e)
        return
    assert isinstance(config.block_size, int) and config.block_size > 0
    assert isinstance(config.queue_depth, int) and config.queue_depth > 0
    assert isinstance(config.intra_op_parallelism, int) and config.intra_op_parallelism > 0
    assert isinstance(config.single_submit, bool) and isinstance(config.overlap_events, bool)
    assert AioConfig.from_dict(config.to_dict(), base=AioConfig()) == config


@QUICK
@given(values=st.dictionaries(st.sampled_from(AioConfig.keys() + tuple(ALIASES)), config_values, max_size=4))
def test_random_settings_give_a_working_handle_or_a_clear_error(engines, fuzz_dir, values):
    values = {k: v for k, v in values.items() if k != "engine" or v != "windows"}
    if any(
        isinstance(v, int) and not isinstance(v, bool) and v > 4096
        for k, v in values.items()
        if ALIASES.get(k, k) in ("queue_depth", "intra_op_parallelism")
    ):
        values = {k: v for k, v in values.items() if ALIASES.get(k, k) == "block_size" or not isinstance(v, int)}
    try:
        h = AsyncIOHandle(**values)
    except (ValueError, TypeError, OSError) as e:
        assert str(e)
        return
    with h:
        t = torch.arange(10_000, dtype=torch.int32)
        h.write(t, fuzz_dir / "settings")
        back = torch.empty_like(t)
        h.read(back, fuzz_dir / "settings")
        assert torch.equal(back, t)
