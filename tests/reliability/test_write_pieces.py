"""One file written in pieces, all in flight together (as DeepSpeed's swapper and fast checkpoint writer do): every
piece lands, whatever the layout, submission order, thread count, engine or surface, compared byte for byte with
what the writes mean. The DeepSpeed surface never shortens a file; on the native API a whole-file write (offset 0,
default ``truncate``) cuts only bytes that no write running alongside it put there."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepoffload import AsyncIOHandle, aligned_empty
from deepoffload.io.compat import aio_handle
from deepoffload.io.engines import engine_status

QUICK = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
THOROUGH = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SURFACES = ["deepspeed-path", "deepspeed-fd", "native-pieces", "native-whole-file-first"]


def usable_engines() -> list[str]:
    return [engine for engine, (ok, _) in engine_status().items() if ok]


@st.composite
def layouts(draw):
    """Cut points of one file region (page multiples, 512-byte multiples or anywhere), pieces left out (gaps), the
    submission order, what the file held before, and the handle's settings."""
    total = draw(st.integers(1, 1 << 20))
    n_cuts = draw(st.integers(0, 12))
    grain = draw(st.sampled_from([1, 512, 4096]))
    cuts = sorted({draw(st.integers(1, max(1, total - 1))) // grain * grain for _ in range(n_cuts)} - {0})
    bounds = [0] + [c for c in cuts if c < total] + [total]
    pieces = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    kept = [p for p in pieces if draw(st.integers(0, 4)) > 0] or pieces[:1]
    return {
        "pieces": kept,
        "order_seed": draw(st.integers(0, 2**31)),
        "prior": draw(st.sampled_from([0, 1000, total // 2, total + 5000])),  # bytes the file holds before
        "threads": draw(st.integers(1, 5)),
        "block_size": draw(st.sampled_from([1024, 4096, 8192, 65536, 1 << 20])),
        "queue_depth": draw(st.integers(1, 32)),
        "engine_index": draw(st.integers(0, 10)),
        "surface": draw(st.sampled_from(SURFACES)),
        "unaligned": draw(st.booleans()),  # piece buffers at odd addresses (bounce path)
    }


def check_layout(folder, case) -> None:
    engines = usable_engines()
    engine = engines[case["engine_index"] % len(engines)]
    path = str(folder / f"pieces-{case['order_seed']}")
    prior = torch.randint(
        0, 256, (case["prior"],), dtype=torch.uint8, generator=torch.Generator().manual_seed(case["order_seed"] + 1)
    )
    with open(path, "wb") as f:
        f.write(prior.numpy().tobytes())
    order = list(case["pieces"])
    random.Random(case["order_seed"]).shuffle(order)
    surface = case["surface"]
    if surface == "native-whole-file-first":
        # The offset-0 piece (a whole-file write) first, the rest after it. Without gaps: what a gap holds then
        # depends on timing (the old bytes if the whole-file write finished alongside a later piece, else zeros).
        ends = [b for _, b in sorted(order)]
        order = list(zip([0] + ends[:-1], ends))
        rest = order[1:]
        random.Random(case["order_seed"]).shuffle(rest)
        order = order[:1] + rest

    end = max(b for _, b in order)
    expected = torch.zeros(max(end, case["prior"]), dtype=torch.uint8)
    expected[: case["prior"]] = prior
    gen = torch.Generator().manual_seed(case["order_seed"])
    buffers = []
    for a, b in order:
        data = torch.randint(1, 256, (b - a,), dtype=torch.uint8, generator=gen)
        buf = torch.empty(b - a + 1, dtype=torch.uint8)[1:] if case["unaligned"] else aligned_empty(b - a, torch.uint8)
        buf.copy_(data)
        buffers.append(buf)
        expected[a:b] = data
    if surface == "native-whole-file-first" and order[0][0] == 0:
        expected = expected[:end]  # the whole-file write cuts what was there before, never the pieces

    settings_ = dict(
        block_size=case["block_size"], queue_depth=case["queue_depth"], intra_op_parallelism=case["threads"]
    )
    if surface.startswith("deepspeed"):
        h = aio_handle(**settings_, engine=engine)
        fd = os.open(path, os.O_WRONLY) if surface == "deepspeed-fd" else None
        try:
            for (a, _), buf in zip(order, buffers):
                assert h.async_pwrite(buf, path if fd is None else fd, a) == 0
            assert h.wait() == len(order)
        finally:
            if fd is not None:
                os.close(fd)
    else:
        with AsyncIOHandle(engine=engine, **{**settings_, "block_size": max(4096, case["block_size"])}) as h:
            requests = [
                h.write_async(buf, path, a, truncate=False if surface == "native-pieces" else None)
                for (a, _), buf in zip(order, buffers)
            ]
            for r in requests:
                r.wait()
    with open(path, "rb") as f:
        got = f.read()
    assert len(got) == expected.numel(), (len(got), expected.numel(), case)
    mismatch = torch.nonzero(torch.frombuffer(bytearray(got), dtype=torch.uint8) != expected)
    assert mismatch.numel() == 0, f"first differing byte at {mismatch[0].item() if mismatch.numel() else -1}: {case}"
    os.remove(path)


@QUICK
@given(case=layouts())
def test_pieces_in_flight_all_land(scratch, case):
    check_layout(scratch, case)


@pytest.mark.slow
@THOROUGH
@given(case=layouts())
def test_pieces_in_flight_all_land_thorough(scratch, case):
    check_layout(scratch, case)


@pytest.mark.parametrize("threads", [1, 4])
def test_issue_example_second_half_then_first_half(scratch, threads):
    """4 MiB at offset 4 MiB, then 4 MiB at offset 0, through the DeepSpeed surface: 8 MiB, both halves."""
    n = 4 << 20
    path = str(scratch / "halves")
    h = aio_handle(1 << 20, 32, False, True, threads)
    second, first = torch.full((n,), 2, dtype=torch.uint8), torch.full((n,), 1, dtype=torch.uint8)
    assert h.sync_pwrite(second, path, n) == 1
    assert h.sync_pwrite(first, path, 0) == 1
    with open(path, "rb") as f:
        data = f.read()
    assert data == b"\x01" * n + b"\x02" * n


@pytest.mark.parametrize("threads", [1, 4])
def test_many_pieces_submitted_together_repeatedly(scratch, threads):
    """The reported failure: pieces at offsets 0, n, 2n, ... submitted together, then wait(); 10 rounds."""
    n, k = 256 << 10, 8
    h = aio_handle(1 << 20, 32, False, True, threads)
    for round_ in range(10):
        path = str(scratch / f"round{round_}")
        bufs = [torch.full((n,), i + 1, dtype=torch.uint8) for i in range(k)]
        for i, b in enumerate(bufs):
            h.async_pwrite(b, path, i * n)
        assert h.wait() == k
        with open(path, "rb") as f:
            data = f.read()
        assert data == b"".join(bytes([i + 1]) * n for i in range(k)), f"round {round_}"


def test_whole_file_write_still_replaces_an_older_file(scratch):
    """The native API's default at offset 0: a file written earlier (and complete) is replaced, no stale tail."""
    path = scratch / "whole"
    path.write_bytes(b"x" * 100_000)
    with AsyncIOHandle() as h:
        h.write(torch.full((5000,), 7, dtype=torch.uint8), path)
    assert path.read_bytes() == b"\x07" * 5000


def test_whole_file_write_keeps_writes_running_alongside(scratch):
    """A whole-file write at offset 0 followed at once by a write further on: both land, nothing cut."""
    path = scratch / "alongside"
    path.write_bytes(b"x" * (3 << 20))
    n = 1 << 20
    with AsyncIOHandle(intra_op_parallelism=2) as h:
        a = h.write_async(torch.full((n,), 1, dtype=torch.uint8), path)  # truncates: whole-file write
        b = h.write_async(torch.full((n,), 2, dtype=torch.uint8), path, n)  # piece: kept
        a.wait(), b.wait()
    assert path.read_bytes() == b"\x01" * n + b"\x02" * n
