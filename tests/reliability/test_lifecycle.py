"""Lifetimes: handles dropped with transfers in flight, interpreter exit with transfers in flight, waiting twice
or with nothing pending, closing twice, and no descriptor leaked by many handles and failing transfers.

What is guaranteed (and tested here): dropping or closing a handle waits for its transfers in flight, so a write
submitted before is complete on storage afterwards; a request outlives its handle and still reports its result; at
interpreter exit an atexit hook closes every live handle, so writes in flight complete and the exit status is 0.
"""

from __future__ import annotations

import errno
import gc
import itertools

import pytest
import torch

from deepoffload import AsyncIOHandle, aligned_empty

from .conftest import open_fds

MiB = 1 << 20


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def file_equals(path, tensor: torch.Tensor) -> bool:
    return path.read_bytes() == tensor.numpy().tobytes()


def test_dropping_a_handle_with_writes_in_flight_completes_them(engines, scratch):
    for engine in engines:
        data = [pattern(16 * MiB + i, seed=i) for i in range(4)]
        h = AsyncIOHandle(engine=engine, intra_op_parallelism=2)
        for i, t in enumerate(data):
            h.write_async(t, scratch / f"{engine}-{i}")
        del h  # the caller kept neither the handle nor its requests
        gc.collect()
        for i, t in enumerate(data):
            assert file_equals(scratch / f"{engine}-{i}", t), f"{engine}: write {i} incomplete after the handle died"


def test_requests_outlive_their_handle(engines, scratch):
    for engine in engines:
        data = pattern(24 * MiB, seed=1)
        h = AsyncIOHandle(engine=engine)
        write = h.write_async(data, scratch / engine)
        failing = h.read_async(torch.empty(100, dtype=torch.uint8), scratch / "missing-dir" / "x")
        del h
        gc.collect()
        assert write.wait() == data.numel() and write.done()
        with pytest.raises(FileNotFoundError):
            failing.wait()
        assert file_equals(scratch / engine, data)


def test_dropping_the_destination_of_a_read_in_flight_is_safe(handle, scratch):
    """The request keeps its tensor alive: the native side never writes into freed memory."""
    path = scratch / "src"
    data = pattern(32 * MiB, seed=3)
    handle.write(data, path)
    dst = aligned_empty(data.numel())
    request = handle.read_async(dst, path)
    del dst
    gc.collect()
    assert request.wait() == data.numel()
    back = torch.empty_like(data)
    handle.read(back, path)
    assert torch.equal(back, data)


def test_wait_twice_and_with_nothing_pending(handle, scratch):
    assert handle.wait_all() == 0 and handle.wait_all() == 0, "nothing pending: 0, twice"
    ok = handle.write_async(pattern(1000, seed=0), scratch / "a")
    assert ok.wait() == 1000 and ok.wait() == 1000 and ok.wait(timeout=0) == 1000
    short = scratch / "short"
    short.write_bytes(b"x" * 10)
    bad = handle.read_async(torch.empty(4096, dtype=torch.uint8), short)
    with pytest.raises(OSError) as first:
        bad.wait()
    with pytest.raises(OSError) as second:
        bad.wait()
    assert first.value is second.value and first.value.errno == errno.ENODATA
    assert handle.wait_all() == 0, "collected requests are not pending any more"
    pending = [handle.write_async(pattern(2 * MiB, seed=k), scratch / f"p{k}") for k in range(3)]
    assert handle.wait_all() == 3 and handle.wait_all() == 0
    assert all(r.wait() == 2 * MiB for r in pending), "waiting after wait_all returns the same result"


def test_close_twice_and_use_after_close(aio, scratch):
    h = AsyncIOHandle()
    request = h.write_async(pattern(8 * MiB, seed=5), scratch / "c")
    h.close()
    h.close()
    assert request.wait() == 8 * MiB, "close waited; the result is still there"
    with pytest.raises(ValueError, match="closed"):
        h.write_async(torch.empty(1), scratch / "d")
    assert h.wait_all() == 0


def test_no_descriptor_leaks_from_many_handles_and_failing_transfers(engines, scratch):
    short = scratch / "short"
    short.write_bytes(b"y" * 100)
    small = pattern(70_000, seed=9)

    def churn(rounds: int) -> None:
        for engine, threads, k in itertools.product(engines, (1, 3), range(rounds)):
            h = AsyncIOHandle(engine=engine, intra_op_parallelism=threads, block_size=65536, queue_depth=4)
            h.write(small, scratch / "ok")
            failing = [
                h.read_async(torch.empty(4096, dtype=torch.uint8), short),  # past the end
                h.read_async(torch.empty(10), scratch / "nope" / "x"),  # missing folder
                h.write_async(torch.empty(10), scratch),
            ]  # a folder, not a file
            for r in failing:
                with pytest.raises(OSError):
                    r.wait()
            with pytest.raises(OSError):  # not an open descriptor: refused at submit (its copy cannot be made)
                h.read_async(torch.empty(10), 999_999)
            if k % 2:
                h.close()
            else:
                h.read_async(torch.empty_like(small), scratch / "ok")
                del h  # with a transfer in flight, never closed explicitly
        gc.collect()

    churn(1)  # warm up: lazily opened descriptors of the process (the op, the self-tests) stay open
    before = open_fds()
    churn(6)
    assert open_fds() == before, "descriptors leaked"


def test_exit_with_writes_in_flight_completes_them(engines, scratch, run_python):
    """A process that exits (normally, from the main module) with writes in flight on every engine: exit status
    0, nothing on stderr, every file complete: the atexit hook closes live handles, which waits for their
    transfers."""
    code = """
import sys, torch
from deepoffload import AsyncIOHandle
folder, engines = sys.argv[1], sys.argv[2].split(",")
gen = torch.Generator().manual_seed(11)
keep = []
for engine in engines:
    h = AsyncIOHandle(engine=engine, intra_op_parallelism=2)
    dropped = AsyncIOHandle(engine=engine)
    data = [torch.randint(0, 256, (32 << 20,), dtype=torch.uint8, generator=gen) for _ in range(3)]
    h.write_async(data[0], f"{folder}/{engine}-a")
    h.write_async(data[1], f"{folder}/{engine}-b")
    request = dropped.write_async(data[2], f"{folder}/{engine}-c")  # the handle itself is unreferenced
    h.read_async(torch.empty(10), folder + "/missing/x")  # a failing transfer nobody waits for
    keep.append((h, request))
print("exiting", flush=True)
"""
    proc = run_python(code, args=(str(scratch), ",".join(engines)))
    assert proc.returncode == 0, proc.stderr
    assert "exiting" in proc.stdout and proc.stderr == "", proc.stderr
    gen = torch.Generator().manual_seed(11)
    for engine in engines:
        for name in "abc":
            expected = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8, generator=gen)
            assert file_equals(scratch / f"{engine}-{name}", expected), f"{engine}-{name} incomplete after exit"


def test_exit_from_a_thread_while_another_thread_has_a_transfer_in_flight(aio, scratch, run_python):
    """sys.exit in the main thread while a daemon thread is blocked in wait(): no abort, no 'terminate called'."""
    code = """
import sys, threading, torch
from deepoffload import AsyncIOHandle
h = AsyncIOHandle(intra_op_parallelism=1)
started = threading.Event()
def work():
    r = h.write_async(torch.zeros(64 << 20, dtype=torch.uint8), sys.argv[1])
    started.set()
    r.wait()
threading.Thread(target=work, daemon=True).start()
started.wait()
sys.exit(0)
"""
    proc = run_python(code, args=(str(scratch / "t"),))
    assert proc.returncode == 0, proc.stderr
    assert "terminate" not in proc.stderr and "Fatal" not in proc.stderr, proc.stderr
    assert (scratch / "t").stat().st_size == 64 << 20
