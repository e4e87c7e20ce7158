"""Signals during large transfers: a 1 ms SIGALRM timer with a Python handler and SIGCHLD from children exiting,
on every usable engine. Every transfer must complete with all its bytes, identical to what was written (the native
side retries EINTR; the Python side waits in slices, so the handlers run while the IO goes on)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from deepoffload import AsyncIOHandle, aligned_empty
from deepoffload.io.engines import engines as registered_engines

NATIVE_ENGINES = [e.name for e in registered_engines() if e.native]  # the registry's, best first

MiB = 1 << 20


@contextmanager
def signal_storm() -> Iterator[dict[str, int]]:
    """SIGALRM every millisecond and a stream of short-lived children (each exit sends SIGCHLD), both with Python
    handlers that count; yields the counts."""
    counts = {"SIGALRM": 0, "SIGCHLD": 0, "children": 0}

    def count(signum, frame):
        counts[signal.Signals(signum).name] += 1

    stop = threading.Event()

    def spawn():
        while not stop.is_set():
            subprocess.run(["true"])
            counts["children"] += 1

    old_alrm = signal.signal(signal.SIGALRM, count)
    old_chld = signal.signal(signal.SIGCHLD, count)
    spawner = threading.Thread(target=spawn, daemon=True)
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
    spawner.start()
    try:
        yield counts
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        stop.set()
        spawner.join()
        signal.signal(signal.SIGALRM, old_alrm)
        signal.signal(signal.SIGCHLD, old_chld)


def round_trips_under_signals(engine: str, nbytes: int, folder) -> dict[str, int]:
    """Write ``nbytes`` of random bytes from a pinned buffer (waiting in native code: signals interrupt its futex
    waits, the handlers run between wait slices), then read them back into a pinned buffer and into an unaligned
    tensor (the bounce path) while polling ``done()`` from Python, all under the signal storm; check every byte."""
    data = aligned_empty(nbytes)
    data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)))
    path = folder / f"{engine}.bin"
    aligned_back = aligned_empty(nbytes)
    unaligned_back = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    aligned_back.zero_()
    unaligned_back.zero_()
    with AsyncIOHandle(engine=engine, intra_op_parallelism=2) as h, signal_storm() as counts:
        assert h.write(data, path) == nbytes
        reads = [h.read_async(aligned_back, path), h.read_async(unaligned_back, path)]
        while not all(r.done() for r in reads):  # poll from Python, so the handlers run between polls too
            time.sleep(0.0002)
        assert [r.wait() for r in reads] == [nbytes, nbytes], "no short read"
        assert h.pending() == 0
    assert path.stat().st_size == nbytes, "no short write"
    assert torch.equal(aligned_back, data), f"{engine}: pinned read differs"
    assert torch.equal(unaligned_back, data), f"{engine}: unaligned (bounce) read differs"
    assert counts["SIGALRM"] > 0 and counts["SIGCHLD"] > 0, f"the signals never arrived during the IO: {counts}"
    return counts


@pytest.mark.parametrize("engine", NATIVE_ENGINES)
def test_64_mib_under_alarm_and_child_signals(engine, engines, scratch):
    if engine not in engines:
        pytest.skip(f"{engine} is not usable here")
    round_trips_under_signals(engine, 64 * MiB, scratch)


@pytest.mark.slow
@pytest.mark.parametrize("engine", NATIVE_ENGINES)
def test_256_mib_under_alarm_and_child_signals(engine, engines, scratch):
    if engine not in engines:
        pytest.skip(f"{engine} is not usable here")
    round_trips_under_signals(engine, 256 * MiB + 4097, scratch)  # and a tail that is not block-aligned
