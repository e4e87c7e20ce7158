"""One protocol for work in flight (``deepoffload.pending.Pending``): ``wait(timeout=None)``, ``done()`` and
``result(timeout=None)`` on a handle's ``Request``, a swapper's ``SwapOut`` and ``SwapIn``, and ``save_async``'s
future; a wait that times out raises ``TimeoutError`` and loses nothing, so a later wait finishes the work."""

from __future__ import annotations

import concurrent.futures
import errno
import inspect
import threading

import pytest
import torch

import deepoffload
from deepoffload.io.request import Request
from deepoffload.pending import Pending, PendingFuture, settle
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.tensor_swapper import SwapIn, SwapOut, TensorSwapper


class Gate(Pending[int]):
    """Stands for a transfer still in flight until ``open()``; then it has moved 0 more bytes."""

    def __init__(self):
        self.opened = False

    def open(self) -> None:
        self.opened = True

    def done(self) -> bool:
        return self.opened

    def wait(self, timeout: float | None = None) -> int:
        if not self.opened:
            if timeout is None:
                raise AssertionError("would block forever")
            raise TimeoutError("still running")
        return 0


@pytest.mark.parametrize("cls", [Request, SwapOut, SwapIn, PendingFuture])
def test_every_kind_of_pending_work_has_the_protocol(cls):
    assert issubclass(cls, Pending)
    for name in ("wait", "result"):
        timeout = inspect.signature(getattr(cls, name)).parameters["timeout"]
        assert timeout.default is None, (cls, name)
    assert deepoffload.Pending is Pending


@pytest.fixture
def swapper(scratch):
    with TensorSwapper(SwapConfig(folder=str(scratch))) as s:
        yield s


def test_a_swap_in_that_times_out_loses_nothing(swapper):
    t = torch.arange(10_000, dtype=torch.float32)
    swapper.swap_out({"g": {"t": t}}).wait(timeout=60)
    read = swapper.swap_in(["g"])
    gate = Gate()
    read._requests.insert(0, gate)  # a read that is still running
    assert not read.done()
    for timeout in (0, 0.01):
        with pytest.raises(TimeoutError) as raised:
            read.wait(timeout=timeout)
        assert raised.value.errno is None
    gate.open()
    assert torch.equal(read.result(timeout=5)["g"]["t"], t)
    assert read.done()  # (after result: the real read behind the gate may still be running when it opens)
    assert read.wait() is read.wait(timeout=0)  # waiting again: the same result
    read.release()


def test_a_swap_out_that_times_out_loses_nothing(swapper):
    t = torch.arange(10_000, dtype=torch.float32)
    write = swapper.swap_out({"g": {"t": t}})
    gate = Gate()
    write._requests.insert(0, gate)
    with pytest.raises(TimeoutError):
        write.wait(timeout=0)
    assert not write.done() and swapper.records("g") == {}  # the new record is not in force yet
    gate.open()
    assert write.result(timeout=5) >= t.nbytes and write.done()  # bytes written, alignment included
    assert torch.equal(swapper.swap_in(["g"]).wait(timeout=5)["g"]["t"], t)


@pytest.mark.parametrize("packed", [False, True], ids=["files", "packed"])
def test_a_swap_in_that_failed_raises_the_same_error_again(scratch, packed):
    """A read whose bytes fail their checksum: every later wait (and result) raises that same ``ChecksumError``, not
    an error about the buffer the first failure released."""
    with TensorSwapper(SwapConfig(folder=str(scratch), checksum=True, pin=False), packed=packed) as swapper:
        swapper.swap_out({"g": {"t": torch.arange(1000.0)}}).wait(timeout=60)
        record = swapper.records("g")["t"]
        with open(record.file, "r+b") as f:
            f.seek(record.offset)
            f.write(b"\xff" * 8)
        read = swapper.swap_in(["g"])
        with pytest.raises(deepoffload.ChecksumError) as first:
            read.wait(timeout=60)
        assert read.done()
        for again in (read.wait, read.result):
            with pytest.raises(deepoffload.ChecksumError) as later:
                again()
            assert later.value is first.value


def test_a_request_is_pending(handle, scratch):
    t = torch.arange(1 << 16)
    request = handle.write_async(t, scratch / "t.bin")
    assert request.result(timeout=60) == t.nbytes and request.done() and request.wait() == t.nbytes


def test_save_async_returns_a_pending_future(scratch):
    future = deepoffload.save_async({"w": torch.arange(100)}, scratch / "c.pt")
    assert isinstance(future, Pending) and isinstance(future, concurrent.futures.Future)
    assert future.wait(timeout=120) == str(scratch / "c.pt")
    assert future.done() and future.result() == str(scratch / "c.pt")
    assert concurrent.futures.wait([future], timeout=0).done == {future}


def test_a_future_not_yet_run_times_out_with_the_builtin_error():
    future = PendingFuture()
    assert not future.done()
    with pytest.raises(TimeoutError):
        future.wait(timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        future.wait(timeout=-1)
    future.run(lambda x: x * 2, 21)
    assert future.done() and future.wait(timeout=0) == 42 and future.result() == 42
    failed = PendingFuture()
    failed.run(lambda: open("/nonexistent/x"))
    assert failed.done()
    with pytest.raises(FileNotFoundError):
        failed.wait()


@pytest.mark.parametrize("timeout", [float("inf"), 1e12], ids=["infinite", "huge"])
def test_a_future_waits_as_long_as_asked(timeout):
    """Any timeout every other wait takes (infinity waits until done) is taken by a future's wait and result too,
    not refused by the clock's range."""
    for wait in ("wait", "result"):
        future = PendingFuture()
        timer = threading.Timer(0.05, future.run, (lambda: 7,))
        timer.start()
        assert getattr(future, wait)(timeout=timeout) == 7
        timer.join()


def test_settle_raises_only_its_own_timeout():
    class Failed(Pending[int]):
        def __init__(self, error):
            self.error = error

        def done(self):
            return True

        def wait(self, timeout=None):
            raise self.error

    # an IO error (even ETIMEDOUT, which Python makes a TimeoutError) is the work's own: kept for its next wait
    settle([Failed(OSError(errno.EIO, "io")), Failed(OSError(errno.ETIMEDOUT, "timed out"))], timeout=0)
    with pytest.raises(TimeoutError):
        settle([Gate()], timeout=0)
