"""``deepoffload.io.staged_file``: the one double-buffered staging writer and read-ahead reader behind checkpoint
streams, safetensors writing and accelerator staging. Contents at odd sizes and offsets, buffer reuse only after
the transfer that used it completed (checked on a log of every transfer), errors, and buffers back in the pool."""

from __future__ import annotations

import errno

import pytest
import torch

from deepoffload.io.staged_file import StagedReader, StagedWriter, StagingPool
from tests.support.fake_accelerator import RecordingHandle, check_log

BUFFER = 8192


def payload(nbytes: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).numpy().tobytes()


@pytest.mark.parametrize("offset", [0, 4096, 777])
@pytest.mark.parametrize("pieces", [[1], [BUFFER], [BUFFER - 1, 2, 3 * BUFFER + 5], [100] * 300])
def test_writer_writes_the_bytes_in_order_from_its_offset(handle, scratch, offset, pieces):
    log: list = []
    recording = RecordingHandle(handle, log)
    pool = StagingPool(BUFFER, keep=2)
    path = scratch / "w"
    path.write_bytes(b"x" * offset)
    data = payload(sum(pieces), seed=len(pieces))
    source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    writer = StagedWriter(recording, str(path), offset, pool=pool, count=2)
    try:
        done = 0
        for n in pieces:
            writer.write(source.data_ptr() + done, n)
            done += n
        writer.drain()
    finally:
        writer.close()
    assert path.read_bytes() == b"x" * offset + data
    offsets = [c[1] for c in recording.calls]
    assert offsets == list(range(offset, offset + len(data), BUFFER)), "one write per full buffer, in order"
    check_log(log)  # no buffer was refilled while its write was in flight, nothing left in flight
    assert len(pool._idle) == min(2, len(offsets)), "buffers went back to the pool"


def test_writer_fsync_waits_for_every_earlier_write(handle, scratch):
    log: list = []
    recording = RecordingHandle(handle, log)
    writer = StagedWriter(recording, str(scratch / "f"), 0, pool=StagingPool(BUFFER, keep=2))
    data = torch.frombuffer(bytearray(payload(2 * BUFFER + 10)), dtype=torch.uint8)
    try:
        writer.write(data.data_ptr(), data.numel())
        writer.submit(fsync=True, truncate=True)
        writer.drain()
    finally:
        writer.close()
    assert [c[4] for c in recording.calls] == [False, False, True]
    last_io = max(i for i, e in enumerate(log) if e[0] == "io")
    assert sum(e[0] == "io_done" for e in log[:last_io]) == 2
    assert (scratch / "f").read_bytes() == data.numpy().tobytes()


def test_writer_error_is_recorded_raised_and_later_writes_refused(handle, scratch):
    writer = StagedWriter(handle, str(scratch / "missing" / "f"), 0, pool=StagingPool(BUFFER, keep=2))
    data = torch.zeros(3 * BUFFER, dtype=torch.uint8)
    try:
        with pytest.raises(OSError) as info:
            writer.write(data.data_ptr(), data.numel())
            writer.drain()
        assert info.value.errno == errno.ENOENT and info.value.filename == str(scratch / "missing" / "f")
        assert writer.error is info.value
        with pytest.raises(OSError):
            writer.write(data.data_ptr(), 1)
    finally:
        writer.close()
    assert handle.pending() == 0


@pytest.mark.parametrize("start,length", [(0, 1), (0, BUFFER), (123, 5 * BUFFER + 7)])
def test_reader_serves_chunks_and_reads_ahead(handle, scratch, start, length):
    data = payload(start + length + 100, seed=3)
    path = scratch / "r"
    path.write_bytes(data)
    log: list = []
    recording = RecordingHandle(handle, log)
    pool = StagingPool(BUFFER, keep=3)
    reader = StagedReader(recording, str(path), start, start + length, pool=pool, depth=3)
    got = b""
    try:
        for k in range(reader.chunk_count):
            got += reader.get(k).numpy().tobytes()
            assert reader.lowest() == k
            assert all(reader.holds(i) for i in range(k, min(k + 3, reader.chunk_count)))
    finally:
        reader.close()
    assert got == data[start : start + length]
    assert [c[1] for c in recording.calls] == list(range(start, start + length, BUFFER)), "each chunk read once"
    check_log(log)


def test_reader_never_serves_a_failed_chunk(handle, scratch):
    path = scratch / "short"
    path.write_bytes(payload(BUFFER + 10))
    reader = StagedReader(handle, str(path), 0, 3 * BUFFER, pool=StagingPool(BUFFER, keep=2), depth=2)
    try:
        assert reader.get(0).numel() == BUFFER
        with pytest.raises(OSError) as info:
            reader.get(1)
        assert info.value.errno == errno.ENODATA and not reader.holds(1)
    finally:
        reader.close()
    assert handle.pending() == 0


def test_pool_refuses_sizes_that_are_not_whole_pages():
    with pytest.raises(ValueError, match="positive multiple"):
        StagingPool(1000, keep=1)
