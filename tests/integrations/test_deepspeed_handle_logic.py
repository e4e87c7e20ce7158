"""The scenarios of DeepSpeed's own handle tests (``tests/unit/ops/aio/test_aio.py`` in its repository; they are not
in its wheel), written afresh: 1 KiB blocks, queue depth 2, two threads, every single_submit/overlap_events pair;
4 KiB reads and writes, sync and async, into plain and page-locked tensors; several files in flight; a file
written and read piece by piece at 1 KiB offsets, by name and through an O_DIRECT descriptor. Each runs on
deepoffload's op and, where it is already built, on DeepSpeed's own (slow: it imports DeepSpeed), with the same
expectations."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

BLOCK, QUEUE_DEPTH, THREADS = 1024, 2, 2
IO_SIZE = 4 * BLOCK
SUBMIT_MODES = [(s, o) for s in (True, False) for o in (True, False)]  # (single_submit, overlap_events)


def deepspeeds_op():
    pytest.importorskip("deepspeed")
    from torch.utils.cpp_extension import _get_build_directory

    if os.environ.get("DEEPOFFLOAD_TEST_DEEPSPEED_OP") != "1":  # a build cached for another venv is rebuilt: minutes
        pytest.skip("set DEEPOFFLOAD_TEST_DEEPSPEED_OP=1 to compare with DeepSpeed's own async_io op")
    if not any(Path(_get_build_directory("async_io", verbose=False)).glob("async_io*.so")):
        pytest.skip("DeepSpeed's async_io op is not built here (building it takes minutes)")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load(verbose=False)


@pytest.fixture(scope="module", params=["deepoffload", pytest.param("deepspeed", marks=pytest.mark.slow)])
def op(request):
    if request.param == "deepspeed":
        return deepspeeds_op()
    from deepoffload.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load()


def handle(op, single_submit: bool = True, overlap_events: bool = True):
    h = op.aio_handle(BLOCK, QUEUE_DEPTH, single_submit, overlap_events, THREADS)
    assert (
        h.get_block_size(),
        h.get_queue_depth(),
        h.get_single_submit(),
        h.get_overlap_events(),
        h.get_intra_op_parallelism(),
    ) == (BLOCK, QUEUE_DEPTH, single_submit, overlap_events, THREADS)
    return h


def buffer(h, locked: bool, nbytes: int = IO_SIZE, fill: bytes | None = None) -> torch.Tensor:
    """A uint8 tensor: page-locked by the handle, or plain memory; holding ``fill`` if given."""
    t = (
        h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        if locked
        else torch.empty(nbytes, dtype=torch.uint8)
    )
    if fill is not None:
        t.copy_(torch.frombuffer(bytearray(fill), dtype=torch.uint8))
    return t


def reference_file(folder: Path, name: str, nbytes: int = IO_SIZE) -> tuple[Path, bytes]:
    data = os.urandom(nbytes)
    path = folder / name
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("locked", [True, False])
@pytest.mark.parametrize("single_submit, overlap_events", SUBMIT_MODES)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_read(op, scratch, asynchronous, single_submit, overlap_events, locked):
    h = handle(op, single_submit, overlap_events)
    path, data = reference_file(scratch, "ref")
    out = buffer(h, locked)
    if asynchronous:
        assert h.async_pread(out, str(path), 0) == 0
        assert h.wait() == 1
    else:
        assert h.sync_pread(out, str(path), 0) == 1
    assert bytes(out.numpy()) == data
    if locked:
        h.free_cpu_locked_tensor(out)


@pytest.mark.parametrize("locked", [True, False])
@pytest.mark.parametrize("single_submit, overlap_events", SUBMIT_MODES)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_write(op, scratch, asynchronous, single_submit, overlap_events, locked):
    h = handle(op, single_submit, overlap_events)
    data = os.urandom(IO_SIZE)
    src = buffer(h, locked, fill=data)
    path = scratch / "written"
    if asynchronous:
        assert h.async_pwrite(src, str(path), 0) == 0
        assert h.wait() == 1
    else:
        assert h.sync_pwrite(src, str(path), 0) == 1
    if locked:
        h.free_cpu_locked_tensor(src)
    assert path.read_bytes() == data


@pytest.mark.parametrize("locked", [True, False])
@pytest.mark.parametrize("files", [2, 3])
def test_several_files_in_flight(op, scratch, files, locked):
    h = handle(op)
    refs = [reference_file(scratch, f"ref{i}") for i in range(files)]
    outs = [buffer(h, locked) for _ in range(files)]
    for (path, _), out in zip(refs, outs):
        assert h.async_pread(out, str(path), 0) == 0
    assert h.wait() == files
    assert [bytes(out.numpy()) for out in outs] == [data for _, data in refs]
    payloads = [os.urandom(IO_SIZE) for _ in range(files)]
    srcs = [buffer(h, locked, fill=p) for p in payloads]
    for i, src in enumerate(srcs):
        assert h.async_pwrite(src, str(scratch / f"out{i}"), 0) == 0
    assert h.wait() == files
    assert [(scratch / f"out{i}").read_bytes() for i in range(files)] == payloads


PARTITIONS = [[1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1]]  # piece lengths in blocks


@pytest.mark.parametrize("use_fd", [False, True])
@pytest.mark.parametrize("partitions", PARTITIONS)
def test_write_piece_by_piece_at_offsets(op, scratch, partitions, use_fd):
    """Each piece lands at its offset and the file equals the bytes written so far (nothing cut, nothing padded)."""
    h = handle(op)
    data = os.urandom(sum(partitions) * BLOCK)
    src = buffer(h, True, len(data), fill=data)
    path = scratch / "pieces"
    offset = 0
    for blocks in partitions:
        piece = src.narrow(0, offset, blocks * BLOCK)
        if use_fd:
            fd = os.open(path, os.O_DIRECT | os.O_CREAT | os.O_WRONLY, 0o644)
            try:
                assert h.async_pwrite(buffer=piece, fd=fd, file_offset=offset) == 0
                assert h.wait() == 1
            finally:
                os.close(fd)
        else:
            assert h.async_pwrite(buffer=piece, filename=str(path), file_offset=offset) == 0
            assert h.wait() == 1
        offset += blocks * BLOCK
        assert path.read_bytes() == data[:offset]
    h.free_cpu_locked_tensor(src)


@pytest.mark.parametrize("partitions", PARTITIONS)
def test_read_piece_by_piece_at_offsets(op, scratch, partitions):
    h = handle(op)
    path, data = reference_file(scratch, "ref", sum(partitions) * BLOCK)
    dst = buffer(h, True, len(data))
    offset = 0
    for blocks in partitions:
        piece = dst.narrow(0, 0, blocks * BLOCK)
        assert h.sync_pread(piece, str(path), offset) == 1
        assert bytes(piece.numpy()) == data[offset : offset + blocks * BLOCK]
        offset += blocks * BLOCK
    h.free_cpu_locked_tensor(dst)
