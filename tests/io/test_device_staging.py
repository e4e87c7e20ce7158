"""The accelerator staging layer (``DeviceStager`` and the handle's device paths) against a fake accelerator whose
copies run only when synchronized: contents at odd sizes, buffer ordering, overlap, errors on both sides and the
fallback to ordinary memory. The same transfers on a real accelerator are in tests/io/test_device_real.py."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch

from deepoffload.io import accelerator
from deepoffload.io.buffers import aligned_empty, is_aligned
from deepoffload.io.staging import DeviceStager
from tests.support.fake_accelerator import FakeAccelerator, RecordingHandle, check_log

CHUNK = 8192
SIZES = [1, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17]


@pytest.fixture
def fake():
    acc = FakeAccelerator()
    with accelerator.use(acc):
        yield acc


@pytest.fixture
def stager(fake, handle):
    return DeviceStager(RecordingHandle(handle, fake.log), chunk_bytes=CHUNK)


def payload(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def chunk_calls(stager: DeviceStager, kind: str) -> list[tuple]:
    return [c for c in stager.handle.calls if c[0] == kind]


@pytest.mark.parametrize("offset", [0, 12345])
@pytest.mark.parametrize("nbytes", SIZES)
def test_read_at_odd_sizes_and_offsets(fake, stager, scratch, nbytes, offset):
    data = payload(offset + nbytes)
    path = scratch / "src"
    path.write_bytes(data.numpy().tobytes())
    device = fake.empty_like(torch.empty(nbytes, dtype=torch.uint8))
    assert stager.read(device, path, offset) == nbytes
    assert torch.equal(device, data[offset:]), "every chunk landed where it belongs"
    reads = chunk_calls(stager, "read")
    assert [(c[1], c[2]) for c in reads] == [(offset + s, min(CHUNK, nbytes - s)) for s in range(0, nbytes, CHUNK)]
    check_log(fake.log)


@pytest.mark.parametrize("nbytes", SIZES)
def test_write_at_odd_sizes_leaves_the_file_exactly_the_tensor(fake, stager, scratch, nbytes):
    path = scratch / "dst"
    path.write_bytes(b"\xff" * (nbytes + 3 * CHUNK))  # a longer file: its tail must go
    values = payload(nbytes, seed=1)
    device = fake.to_device(values)
    assert stager.write(device, path) == nbytes
    assert path.read_bytes() == values.numpy().tobytes()
    writes = chunk_calls(stager, "write")
    assert [c[3] for c in writes] == [False] * (len(writes) - 1) + [True], "only the last chunk truncates"
    check_log(fake.log)


def test_write_at_an_offset_keeps_what_is_before_and_after(fake, stager, scratch):
    path = scratch / "dst"
    path.write_bytes(b"a" * (5 * CHUNK))
    values = payload(2 * CHUNK + 5, seed=2)
    stager.write(fake.to_device(values), path, 1000)
    raw = path.read_bytes()
    assert raw[:1000] == b"a" * 1000 and raw[1000 : 1000 + values.numel()] == values.numpy().tobytes()
    assert raw[1000 + values.numel() :] == b"a" * (5 * CHUNK - 1000 - values.numel()), "no truncation by default"
    check_log(fake.log)


def test_float_tensors_round_trip_through_a_file_descriptor(fake, stager, scratch):
    values = torch.randn(3, 5001, generator=torch.Generator().manual_seed(3))
    path = scratch / "fd"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        stager.write(fake.to_device(values), fd)
        back = fake.empty_like(values)
        stager.read(back, fd)
    finally:
        os.close(fd)
    assert torch.equal(back, values) and path.stat().st_size == values.numel() * 4
    check_log(fake.log)


def test_fsync_goes_with_the_last_chunk_after_every_other_write_completed(fake, stager, scratch):
    stager.write(fake.to_device(payload(3 * CHUNK + 1)), scratch / "f", fsync=True)
    assert [c[4] for c in chunk_calls(stager, "write")] == [False, False, False, True]
    last_io = max(i for i, e in enumerate(fake.log) if e[0] == "io")
    assert sum(e[0] == "io_done" for e in fake.log[:last_io]) == 3, "earlier chunks were written before the fsync"


def test_file_io_of_the_next_chunk_overlaps_the_device_copy(fake, stager, scratch):
    nbytes = 4 * CHUNK
    path = scratch / "o"
    stager.write(fake.to_device(payload(nbytes, seed=4)), path)
    log = fake.log
    d2h = [i for i, e in enumerate(log) if e[0] == "copy" and e[1] == "d2h"]
    io_done = [i for i, e in enumerate(log) if e[0] == "io_done"]
    # write: the copy of chunk k+1 is queued before the file write of chunk k has completed
    assert all(d2h[k + 1] < io_done[k] for k in range(3)), log
    del log[:]
    stager.read(fake.empty_like(torch.empty(nbytes, dtype=torch.uint8)), path)
    reads = [i for i, e in enumerate(log) if e[0] == "io"]
    copied = [i for i, e in enumerate(log) if e[0] == "copied"]
    # read: chunk k+1 is read from the file before the copy of chunk k is waited for
    assert all(reads[k + 1] < copied[k] for k in range(3)), log
    check_log(log)


def test_side_stream_waits_for_the_current_stream_on_every_call(fake, stager, scratch):
    stager.write(fake.to_device(payload(10)), scratch / "w")
    stager.read(fake.empty_like(torch.empty(10, dtype=torch.uint8)), scratch / "w")
    assert [e[0] for e in fake.log].count("wait_for_current") == 2
    assert [e[0] for e in fake.log].count("new_stream") == 1, "the stream is made once per device"


def test_failed_read_names_path_and_offset_and_leaves_nothing_in_flight(fake, stager, handle, scratch):
    path = scratch / "short"
    path.write_bytes(payload(2 * CHUNK + 100).numpy().tobytes())
    device = fake.empty_like(torch.empty(4 * CHUNK, dtype=torch.uint8))
    with pytest.raises(OSError) as info:
        stager.read(device, path)
    assert info.value.errno == errno.ENODATA and info.value.filename == str(path)
    assert "offset" in str(info.value) and "read" in str(info.value)
    assert handle.pending() == 0
    check_log(fake.log)
    small = fake.empty_like(torch.empty(CHUNK + 1, dtype=torch.uint8))
    stager.read(small, path)  # the stager is usable again
    assert torch.equal(small, payload(2 * CHUNK + 100)[: CHUNK + 1])


def test_failed_write_names_the_path_and_leaves_the_device_tensor_intact(fake, stager, handle, scratch):
    values = payload(3 * CHUNK, seed=5)
    device = fake.to_device(values)
    target = scratch / "missing-folder" / "f"
    with pytest.raises(OSError) as info:
        stager.write(device, target)
    assert info.value.errno == errno.ENOENT and info.value.filename == str(target)
    assert torch.equal(device, values) and handle.pending() == 0
    check_log(fake.log)


def test_disk_full_in_the_middle_of_a_write(fake, stager, handle, small_fs):
    folder = small_fs(4 << 20, "tmpfs")
    values = payload(6 << 20, seed=6)
    device = fake.to_device(values)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "deepoffload: the filesystem .* refuses O_DIRECT", RuntimeWarning)
        with pytest.raises(OSError) as info:
            stager.write(device, folder / "big")
        assert info.value.errno == errno.ENOSPC and "write" in str(info.value)
        assert torch.equal(device, values) and handle.pending() == 0
        check_log(fake.log)
        os.unlink(folder / "big")
        stager.write(fake.to_device(payload(CHUNK + 3)), folder / "small")  # carries on once there is room
    assert (folder / "small").read_bytes() == payload(CHUNK + 3).numpy().tobytes()


@pytest.mark.parametrize("direction", ["read", "write"])
def test_a_device_error_is_raised_after_the_file_io_in_flight_completed(handle, scratch, direction):
    fake = FakeAccelerator(fail_sync_at=2)
    with accelerator.use(fake):
        stager = DeviceStager(RecordingHandle(handle, fake.log), chunk_bytes=CHUNK)
        path = scratch / "e"
        path.write_bytes(payload(4 * CHUNK).numpy().tobytes())
        with pytest.raises(RuntimeError, match="fake device error"):
            if direction == "read":
                stager.read(fake.empty_like(torch.empty(4 * CHUNK, dtype=torch.uint8)), path)
            else:
                stager.write(fake.to_device(payload(4 * CHUNK)), path)
        assert handle.pending() == 0
        ios = [e for e in fake.log if e[0] == "io"]
        assert len([e for e in fake.log if e[0] == "io_done"]) == len(ios), "every file transfer was waited for"
        back = fake.empty_like(torch.empty(CHUNK, dtype=torch.uint8))
        stager.read(back, path)
        assert torch.equal(back, payload(4 * CHUNK)[:CHUNK])


def test_backend_without_streams_copies_synchronously(handle, scratch):
    fake = FakeAccelerator(streams=False)
    with accelerator.use(fake):
        stager = DeviceStager(RecordingHandle(handle, fake.log), chunk_bytes=CHUNK)
        values = payload(2 * CHUNK + 9, seed=7)
        stager.write(fake.to_device(values), scratch / "s")
        back = fake.empty_like(values)
        stager.read(back, scratch / "s")
    assert torch.equal(back, values)
    check_log(fake.log)


def test_pinned_memory_from_the_accelerators_allocator_is_aligned(handle, scratch):
    fake = FakeAccelerator(pinning="allocator")
    with accelerator.use(fake):
        buffer = aligned_empty(10000, alignment=4096)
        assert is_aligned(buffer, 4096) and fake.is_pinned(buffer.data_ptr(), 10000)
        stager = DeviceStager(RecordingHandle(handle, fake.log), chunk_bytes=CHUNK)
        values = payload(3 * CHUNK, seed=8)
        stager.write(fake.to_device(values), scratch / "a")
        back = fake.empty_like(values)
        stager.read(back, scratch / "a")
    assert torch.equal(back, values)
    check_log(fake.log)  # every copy used memory the accelerator pinned


def test_registered_buffers_are_unregistered_when_freed(fake):
    buffer = aligned_empty(3 * 4096)
    ptr = buffer.data_ptr()
    assert fake.is_pinned(ptr, 3 * 4096)
    del buffer
    assert not fake.is_pinned(ptr, 1) and ("unregister", ptr) in fake.log


def test_no_pinning_falls_back_to_ordinary_memory_and_warns_once(handle, scratch, monkeypatch):
    monkeypatch.setattr(accelerator, "_warned_unpinned", False)
    fake = FakeAccelerator(pinning="none")
    with accelerator.use(fake), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = aligned_empty(4096), aligned_empty(8192)
        assert is_aligned(first) and is_aligned(second)
        stager = DeviceStager(handle, chunk_bytes=CHUNK)
        values = payload(2 * CHUNK + 1, seed=9)
        stager.write(fake.to_device(values), scratch / "u")
        back = fake.empty_like(values)
        stager.read(back, scratch / "u")
    assert torch.equal(back, values)
    messages = [str(w.message) for w in caught if "page-lock host memory" in str(w.message)]
    assert len(messages) == 1 and "fake accelerator" in messages[0], messages


def test_handle_read_and_write_stage_device_tensors_in_chunks(fake, handle, scratch):
    values = torch.randn(5_000_003, generator=torch.Generator().manual_seed(10))  # three 8 MiB chunks
    device = fake.to_device(values)
    handle.write(device, scratch / "h", validate=True)
    back = fake.empty_like(values)
    handle.read(back, scratch / "h")
    assert torch.equal(back, values)
    copies = [e for e in fake.log if e[0] == "copy"]
    assert len(copies) == 2 * -(-values.numel() * 4 // handle._device_stager().chunk_bytes)
    assert len({e[2] for e in copies}) == 2, "two host buffers, used in turn"
    check_log(fake.log)


def test_handle_async_transfers_bounce_device_tensors_through_one_pinned_buffer(fake, handle, scratch):
    values = torch.arange(5000, dtype=torch.float64)
    handle.write_async(fake.to_device(values), scratch / "a").wait()
    back = fake.empty_like(values)
    handle.read_async(back, scratch / "a").wait()
    assert torch.equal(back, values)
    copies = [e for e in fake.log if e[0] == "copy"]
    assert [(e[1], e[3], e[4]) for e in copies] == [("d2h", 40000, True), ("h2d", 40000, True)]


def test_host_tensors_are_not_staged(fake, handle, scratch):
    values = torch.arange(1000, dtype=torch.int32)
    handle.write(values, scratch / "c")
    back = torch.empty_like(values)
    handle.read(back, scratch / "c")
    assert torch.equal(back, values) and not [e for e in fake.log if e[0] == "copy"]
    with pytest.raises(ValueError, match="goes through AsyncIOHandle directly"):
        DeviceStager(handle).read(back, scratch / "c")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_chunk_bytes_must_be_a_positive_integer(handle, bad):
    with pytest.raises(ValueError, match="chunk_bytes must be a positive integer"):
        DeviceStager(handle, chunk_bytes=bad)


def test_failed_host_registration_warns_once_and_leaves_ordinary_memory(monkeypatch):
    monkeypatch.setattr(accelerator, "_warned_unpinned", False)
    calls = []
    monkeypatch.setitem(accelerator._HOST_REGISTER, "fake", (lambda ptr, n: calls.append(n) or False, None))
    with accelerator.use(accelerator.Accelerator("fake")), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffers = [aligned_empty(4096 * (i + 1)) for i in range(3)]
    assert calls == [4096, 8192, 12288] and all(is_aligned(b) for b in buffers)
    messages = [str(w.message) for w in caught if "page-lock host memory" in str(w.message)]
    assert len(messages) == 1 and "fake accelerator" in messages[0], messages


@pytest.mark.skipif(torch.accelerator.is_available(), reason="torch has a pinned allocator here")
def test_accelerator_without_a_pinned_allocator_warns_once_and_leaves_ordinary_memory(monkeypatch):
    monkeypatch.setattr(accelerator, "_warned_unpinned", False)
    with accelerator.use(accelerator.Accelerator("fake")), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffers = [aligned_empty(5000, alignment=8192) for _ in range(2)]
    assert all(is_aligned(b, 8192) for b in buffers)
    messages = [str(w.message) for w in caught if "page-lock host memory" in str(w.message)]
    assert len(messages) == 1 and "pin_memory" in messages[0], messages
