"""The async-IO handle from Python: round trips checked against Python's own file IO, requests in flight, reads by
fd, every error as an OSError with errno/operation/path/offset, and the DeepSpeed-compatible surface."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys

import pytest
import torch

import deepoffload
from deepoffload import AioConfig, AsyncIOHandle, aligned_empty
from deepoffload.io.engines import engine_status, engines

SIZES = [1, 4096, 1_000_003, 2 * 65536 + 512]  # bytes; the handle below uses 64 KiB blocks
OFFSETS = [0, 4096, 12345]
NATIVE_ENGINES = [e.name for e in engines() if e.native]  # the registry's, best first


def usable_engines() -> list[str]:
    return [e for e, (ok, _) in engine_status().items() if ok]


def make_buffer(kind: str, nbytes: int) -> torch.Tensor:
    if kind == "pinned":
        return aligned_empty(nbytes)
    if kind == "aligned":
        return aligned_empty(nbytes, pin=False)
    return torch.empty(nbytes + 1, dtype=torch.uint8)[1:]  # one byte past an aligned start


def python_read(path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("engine", NATIVE_ENGINES)
def test_round_trips_match_python_file_io(aio, scratch, engine, threads):
    if engine not in usable_engines():
        pytest.skip(f"{engine} is not usable here: {engine_status().get(engine, (False, 'not compiled in'))[1]}")
    gen = torch.Generator().manual_seed(threads)
    for single_submit, overlap in itertools.product([False, True], [False, True]):
        with AsyncIOHandle(
            engine=engine,
            block_size=65536,
            queue_depth=8,
            intra_op_parallelism=threads,
            single_submit=single_submit,
            overlap_events=overlap,
        ) as h:
            for nbytes, offset, kind in itertools.product(SIZES, OFFSETS, ["pinned", "aligned", "unaligned"]):
                path = scratch / f"f-{nbytes}-{offset}-{kind}"
                data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
                src = make_buffer(kind, nbytes)
                src.copy_(data)
                prefix = os.urandom(offset)
                path.write_bytes(prefix)
                assert h.write(src, path, offset) == nbytes
                on_disk = path.read_bytes()
                assert on_disk[:offset] == prefix, "a write at an offset keeps the bytes before it"
                assert on_disk[offset:] == data.numpy().tobytes(), (nbytes, offset, kind)
                dst = make_buffer(kind, nbytes)
                dst.zero_()
                assert h.read(dst, path, offset) == nbytes
                assert torch.equal(dst, data), (engine, threads, single_submit, overlap, nbytes, offset, kind)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64, torch.int64]
)
def test_any_dtype_and_shape(handle, scratch, dtype):
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    path = scratch / "t.bin"
    handle.write(t, path)
    assert path.stat().st_size == t.numel() * t.element_size()
    back = torch.empty_like(t)
    handle.read(back, path)
    assert torch.equal(back, t)
    scalar = torch.tensor(3.5).to(dtype)
    handle.write(scalar, path)
    out = torch.zeros((), dtype=dtype)
    handle.read(out, path)
    assert torch.equal(out, scalar)


def test_overwrite_with_a_shorter_tensor_leaves_exactly_its_bytes(handle, scratch):
    path = scratch / "x"
    handle.write(torch.ones(3 << 20, dtype=torch.uint8), path)
    handle.write(torch.full((1000,), 7, dtype=torch.uint8), path)
    assert path.read_bytes() == bytes([7]) * 1000, "no stale tail from the longer file"
    handle.write(torch.full((10,), 9, dtype=torch.uint8), path, 5000)
    assert path.stat().st_size == 5010, "a write at an offset extends the file"
    handle.write(torch.full((10,), 8, dtype=torch.uint8), path, 0, truncate=False)
    assert path.stat().st_size == 5010


def test_empty_tensor(handle, scratch):
    path = scratch / "empty"
    assert handle.write(torch.empty(0), path) == 0
    assert path.exists() and path.stat().st_size == 0
    assert handle.read(torch.empty(0), path) == 0


def test_many_requests_in_flight_and_several_handles(aio, scratch):
    tensors = [torch.randint(0, 256, (300_000 + i,), dtype=torch.uint8) for i in range(12)]
    with AsyncIOHandle(intra_op_parallelism=2) as a, AsyncIOHandle(engine="posix") as b:
        reqs = [(a if i % 2 else b).write_async(t, scratch / f"m{i}") for i, t in enumerate(tensors)]
        assert a.pending() + b.pending() <= 12
        assert sum(r.wait() for r in reqs) == sum(t.numel() for t in tensors)
        outs = [torch.empty_like(t) for t in tensors]
        reqs = [(b if i % 2 else a).read_async(o, scratch / f"m{i}") for i, o in enumerate(outs)]
        assert a.wait_all() + b.wait_all() == 12
        assert all(r.done() for r in reqs)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))


def test_request_wait_is_repeatable_and_a_context_manager(handle, scratch):
    t = torch.arange(1000, dtype=torch.int32)
    with handle.write_async(t, scratch / "r") as req:
        pass
    assert req.done() and req.wait() == 4000 and req.wait(timeout=0) == 4000
    assert handle.wait_all() == 0, "nothing pending: returns 0, no abort"


def test_reads_and_writes_by_fd(handle, scratch):
    path = scratch / "fd"
    t = torch.randint(0, 256, (123_457,), dtype=torch.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        handle.write(t, fd, 100)
        back = torch.empty_like(t)
        handle.read(back, fd, 100)
        assert torch.equal(back, t)
        os.fstat(fd)  # the caller's descriptor stays open
    finally:
        os.close(fd)


def test_validate_detects_a_mismatch(handle, scratch, monkeypatch):
    path = scratch / "v"
    t = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    assert handle.write(t, path, validate=True) == 10_000
    back = torch.empty_like(t)
    assert handle.read(back, path, validate=True) == 10_000
    with open(path, "r+b") as f:  # the file no longer holds what the tensor holds
        f.seek(5)
        f.write(b"\xff" if t[5] != 255 else b"\x00")
    from deepoffload.io.handle import _validate

    with pytest.raises(deepoffload.ValidationError, match="differ"):
        _validate(t, path, 0)
    with pytest.raises(deepoffload.ValidationError):
        _validate(t, path, 1)


def test_missing_file_raises_with_errno_operation_path_offset(handle, scratch):
    missing = scratch / "nope" / "x"
    with pytest.raises(FileNotFoundError) as info:
        handle.read(torch.empty(10), missing)
    e = info.value
    assert e.errno == errno.ENOENT and e.filename == str(missing)
    assert "open" in str(e) and "offset" in str(e)
    with pytest.raises(FileNotFoundError):
        handle.write(torch.empty(10), missing)


def test_read_past_the_end_raises_and_the_process_lives(handle, scratch):
    path = scratch / "short"
    path.write_bytes(b"x" * 5000)
    with pytest.raises(OSError) as info:
        handle.read(torch.empty(10_000, dtype=torch.uint8), path)
    assert info.value.errno == errno.ENODATA and "5000" in str(info.value)
    with pytest.raises(OSError):
        handle.read(torch.empty(10, dtype=torch.uint8), path, 4999)


def test_permission_denied(handle, scratch):
    if os.geteuid() == 0:
        directory = "/proc/1"  # root bypasses modes, not procfs
        with pytest.raises(OSError) as info:
            handle.write(torch.empty(10), f"{directory}/deepoffload-test")
        assert info.value.errno in (errno.EACCES, errno.EPERM, errno.ENOENT, errno.EROFS)
    else:
        path = scratch / "ro"
        path.write_bytes(b"x")
        path.chmod(0o400)
        with pytest.raises(PermissionError):
            handle.write(torch.empty(10), path)


def test_bad_input_gets_clear_errors(handle, scratch):
    with pytest.raises(ValueError, match="contiguous"):
        handle.write(torch.empty(10, 10).t(), scratch / "x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        handle.write(b"bytes", scratch / "x")
    with pytest.raises(ValueError, match="offset"):
        handle.write(torch.empty(1), scratch / "x", -1)
    with pytest.raises(TypeError, match="path or a file descriptor"):
        handle.write(torch.empty(1), 3.5)
    with pytest.raises(ValueError, match="engine"):
        AsyncIOHandle(engine="nonsense")
    with pytest.raises(ValueError, match="block_size"):
        AsyncIOHandle(block_size=0)
    with pytest.raises(ValueError, match="unknown aio config key"):
        AsyncIOHandle(blocksize=4096)


def test_meta_tensor_is_refused_naming_what_to_do(handle, scratch):
    (scratch / "m").write_bytes(bytes(40))
    for call in (handle.write, handle.read):
        with pytest.raises(ValueError) as info:
            call(torch.empty(10, device="meta"), scratch / "m")
        assert "meta" in str(info.value) and "to_empty" in str(info.value) and "none" not in str(info.value)


def test_a_read_counts_as_an_in_place_change_for_autograd(handle, scratch):
    # Reading into a tensor that a backward pass saved changed it behind autograd's back: backward then used the
    # new bytes and returned a wrong gradient silently. torch's own copy_ makes that backward refuse; so does a read.
    handle.write(torch.full((4,), 3.0), scratch / "w")
    w = torch.ones(4, requires_grad=True)
    loss = (w * w).sum()
    handle.read(w, scratch / "w")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    view = torch.ones(8, requires_grad=True)
    loss = (view * view).sum()
    handle.read_async(view[4:], scratch / "w").wait()  # a view shares its base's counter
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.inference_mode():  # inference tensors have no version counter: still readable
        t = torch.empty(4)
        assert handle.read(t, scratch / "w") == 16 and torch.equal(t, torch.full((4,), 3.0))


def test_closing_a_descriptor_while_its_transfer_runs_cannot_redirect_it(handle, scratch):
    # The transfer used the caller's descriptor number: closed after submit and reused by the next open (the lowest
    # free number), the 64 MiB landed in the other file. Each transfer now uses its own copy, closed when collected.
    data = torch.full((64 << 20,), 5, dtype=torch.uint8)
    fd = os.open(scratch / "mine", os.O_RDWR | os.O_CREAT)
    request = handle.write_async(data, fd)
    copy = request._owned_fd
    assert copy >= 0 and copy != fd
    os.close(fd)
    other = os.open(scratch / "other", os.O_RDWR | os.O_CREAT)
    try:
        assert request.wait() == data.numel()
    finally:
        os.close(other)
    assert (scratch / "mine").stat().st_size == data.numel() and (scratch / "other").stat().st_size == 0
    assert request._owned_fd == -1 and not os.path.exists(f"/proc/self/fd/{copy}")  # the copy is closed
    with pytest.raises(OSError) as info:
        handle.read(torch.empty(4), fd)  # closed now
    assert info.value.errno == errno.EBADF and f"descriptor {fd}" in str(info.value) and "offset 0" in str(info.value)


def test_a_forked_child_closes_its_copies_of_the_parents_descriptors(handle, scratch):
    fd = os.open(scratch / "forked", os.O_RDWR | os.O_CREAT)
    before = set(os.listdir("/proc/self/fd"))
    request = handle.write_async(torch.full((64 << 20,), 7, dtype=torch.uint8), fd)
    pid = os.fork()
    if pid == 0:  # the child: only what was open before the submit (the copy the parent's transfer uses is closed)
        os._exit(0 if set(os.listdir("/proc/self/fd")) <= before else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert request.wait() == 64 << 20 and (scratch / "forked").stat().st_size == 64 << 20
    os.close(fd)


def test_disk_full_raises_enospc(aio, small_fs):
    mnt = small_fs(1 << 20, "tmpfs")
    with AsyncIOHandle() as h:  # tmpfs takes O_DIRECT since Linux 6.6, else the handle falls back
        with pytest.raises(OSError) as info:
            h.write(torch.zeros(4 << 20, dtype=torch.uint8), mnt / "big")
    assert info.value.errno == errno.ENOSPC
    assert "write" in str(info.value) and "big" in str(info.value)


def test_errors_in_a_subprocess_never_abort(aio, scratch):
    """The risky calls of the reference (short file, wait with nothing pending, exit with parallelism 1 and
    operations in flight) run in a child whose exit status must be clean."""
    code = f"""
import torch, deepoffload
from deepoffload.op_builder import AsyncIOBuilder
h = AsyncIOBuilder().load().aio_handle(1048576, 8, False, True, 1)
assert h.wait() == 0
open({str(scratch / "s")!r}, 'wb').write(b'x' * 100)
try:
    h.sync_pread(torch.empty(1000, dtype=torch.uint8), {str(scratch / "s")!r})
except OSError as e:
    print('OSError', e.errno)
big = torch.zeros(64 << 20, dtype=torch.uint8)
h.async_pwrite(big, {str(scratch / "b")!r})
print('exiting with an operation in flight')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "OSError 61" in proc.stdout
    assert "terminate" not in proc.stderr


def test_config_defaults_are_defined_once(monkeypatch):
    monkeypatch.setenv("DEEPOFFLOAD_AIO_ENGINE", "posix")
    monkeypatch.setenv("DEEPOFFLOAD_AIO_QUEUE_DEPTH", "4")
    env = AioConfig.from_env()
    assert env.engine == "posix" and env.queue_depth == 4
    assert AioConfig.from_dict({"thread_count": 2}).intra_op_parallelism == 2


def test_aligned_empty(aio):
    t = aligned_empty((3, 1000), torch.float32)
    assert t.shape == (3, 1000) and t.data_ptr() % 4096 == 0 and deepoffload.is_pinned(t)
    big = aligned_empty(10, torch.uint8, alignment=1 << 16)
    assert big.data_ptr() % (1 << 16) == 0
    assert aligned_empty(0).numel() == 0
    with pytest.raises(ValueError, match="power of two"):
        aligned_empty(10, alignment=3000)
    assert not deepoffload.is_pinned(torch.empty(10))


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s memory backed by RAM now (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = t.numel() * t.element_size() // 4096
    status = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(pages * 4096), status) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in status)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and huge pages: Linux")
def test_large_buffers_start_on_huge_page_boundaries_and_prefault_on_request():
    pages = (8 << 20) // 4096
    lazy = aligned_empty(8 << 20, pin=False)
    assert lazy.data_ptr() % (2 << 20) == 0 and _resident_pages(lazy) == 0
    # its storage starts at its first byte (torch's loader slices storages from there)
    assert lazy.storage_offset() == 0 and lazy.untyped_storage().data_ptr() == lazy.data_ptr()
    ready = aligned_empty(8 << 20, pin=False, prefault=True)
    assert ready.data_ptr() % (2 << 20) == 0 and _resident_pages(ready) == pages
    assert _resident_pages(aligned_empty(8 << 20)) == pages  # locked memory is backed too
    small = aligned_empty(12288, pin=False, prefault=True)
    assert small.data_ptr() % 4096 == 0 and _resident_pages(small) == 3


def _vmstat(name: str) -> int:
    with open("/proc/vmstat") as f:
        return next(int(line.split()[1]) for line in f if line.split()[0] == name)


def _huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    or "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read(),
    reason="no transparent huge pages on this system",
)
def test_large_buffers_ask_for_huge_pages():
    """The kernel either backs the buffer with huge pages or records that it tried and fell back."""
    fallbacks = _vmstat("thp_fault_fallback")
    ready = aligned_empty(16 << 20, pin=False, prefault=True)
    assert _huge_kib(ready.data_ptr()) > 0 or _vmstat("thp_fault_fallback") > fallbacks
    assert _huge_kib(aligned_empty(1 << 20, pin=False, prefault=True).data_ptr()) == 0  # small: ordinary pages


def test_the_gil_is_released_while_waiting(aio, scratch):
    """Another Python thread runs while the main thread waits on a large transfer.

    With a switch interval of a minute, the peer thread gets the GIL only when the main thread gives it up by
    blocking; the transfer is submitted before the peer is let go, so only the wait can give it up. (Counting the
    peer's ticks during one wait, as before, failed when a loaded machine ran the peer only after the transfer.) A
    wait that finds its transfer already done need not release the GIL: then it is tried again, at most 32 times."""
    import sys
    import threading

    big = aligned_empty(256 << 20)
    big.fill_(3)
    interval = sys.getswitchinterval()
    with AsyncIOHandle(engine="posix") as h:
        for _ in range(32):
            ready, ran, gate = threading.Event(), threading.Event(), threading.Lock()
            gate.acquire()

            def peer():
                ready.set()
                with gate:
                    ran.set()

            thread = threading.Thread(target=peer)
            thread.start()
            assert ready.wait(timeout=60)
            req = h.write_async(big, scratch / "gil", fsync=True)
            try:
                sys.setswitchinterval(60)
                gate.release()
                req.wait()
                waited_with_gil_released = ran.is_set()
            finally:
                sys.setswitchinterval(interval)
                thread.join()
            if waited_with_gil_released:
                break
    assert waited_with_gil_released, "the waiting thread held the GIL"


def test_filesystem_without_o_direct_falls_back_to_buffered_and_warns_once(aio, small_fs):
    import warnings

    mnt = small_fs(0, "ramfs")
    t = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8)
    with AsyncIOHandle() as h, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.write(t, mnt / "a")
        h.write(t, mnt / "b")
        back = torch.empty_like(t)
        h.read(back, mnt / "a")
    assert torch.equal(back, t)
    said = [w for w in caught if "refuses O_DIRECT" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]


class _Interrupted(Exception):
    pass


def test_a_signal_during_wait_never_loses_the_transfers_result(scratch):
    """Ctrl-C (any signal handler's exception) while ``wait`` blocks: raised once the native wait returned, it lost
    the result the native side had just handed over, so waiting again raised "unknown op id" and the request (and
    every close waiting for it) could never finish. Now waiting again returns the result."""
    import signal
    import threading
    import time

    armed = threading.Event()  # raise only inside the calls under test (a raise in the loop's own code breaks it)

    def interrupt(signum, frame):
        if armed.is_set():
            raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    stop = threading.Event()

    def pester():
        while not stop.wait(0.002):
            os.kill(os.getpid(), signal.SIGUSR1)

    thread = threading.Thread(target=pester, daemon=True)
    handle, tensor = AsyncIOHandle(), torch.arange(1 << 20, dtype=torch.int32)
    interrupted = collected = 0
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while interrupted < 20 and time.monotonic() < deadline:
            try:
                armed.set()
                request = handle.write_async(tensor, scratch / "f.bin")
            except _Interrupted:
                continue
            finally:
                armed.clear()
            while True:
                try:
                    armed.set()
                    written = request.wait()
                except _Interrupted:
                    interrupted += 1
                    continue
                finally:
                    armed.clear()
                assert written == tensor.nbytes
                collected += 1
                break
    finally:
        armed.clear()
        stop.set()
        thread.join()
        signal.signal(signal.SIGUSR1, previous)
    assert interrupted > 0 and collected > 0
    handle.close()
    assert torch.equal(torch.from_file(str(scratch / "f.bin"), size=tensor.numel(), dtype=torch.int32), tensor)
