"""Files and memory a caller (or an attacker) may hand the handle that are not plain files and plain buffers: FIFOs,
pipes, sockets, character devices, read-only memory, and a process that forks. Each case runs in a child process
with a hard timeout, so a regression that hangs or crashes fails the test instead of stopping the suite."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from deepoffload.io.engines import engines as registered_engines

TIMEOUT_S = 120  # generous: starting torch on a loaded 2-core machine takes seconds; a hang never ends

PRELUDE = """
import errno, os, socket, sys, mmap, warnings
import torch
from deepoffload import AsyncIOHandle
engine, folder = sys.argv[1], sys.argv[2]

def expect_errno(fn, code):
    try:
        fn()
    except OSError as e:
        if e.errno != code:
            raise SystemExit(f"expected errno {errno.errorcode[code]}, got {e!r}")
        return e
    raise SystemExit("expected an OSError, got success")
"""


def run_child(engine: str, folder, body: str, prelude: str = "") -> subprocess.CompletedProcess:
    """Run the case in a fresh interpreter in its own session; on timeout the whole session is killed, so a hung
    grandchild (a forked child, a pool worker) does not outlive the test."""
    code = PRELUDE + prelude + textwrap.dedent(body)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, engine, str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the child process hung (no exit after {TIMEOUT_S} s)")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a child that exited
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{out}\n{err}"
    assert "OK" in out, out + err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(params=[e.name for e in registered_engines() if e.native])  # the registry's, best first
def engine(request, engines) -> str:
    if request.param not in engines:
        pytest.skip(f"engine {request.param} does not work here")
    return request.param


def test_fifo_path_is_refused_not_hung(aio, engine, tmp_path):
    run_child(
        engine,
        tmp_path,
        """
        fifo = os.path.join(folder, "fifo")
        os.mkfifo(fifo)
        with AsyncIOHandle(engine=engine) as h:
            t = torch.zeros(8192, dtype=torch.uint8)
            e = expect_errno(lambda: h.read(t, fifo), errno.ESPIPE)
            assert "FIFO" in str(e) and fifo in str(e), e
            expect_errno(lambda: h.write(t, fifo), errno.ESPIPE)  # no reader: open would block
            expect_errno(lambda: h.write(t, fifo, 4096), errno.ESPIPE)
            ok = os.path.join(folder, "ok.bin")  # later operations on the handle are not stuck behind it
            assert h.write(t, ok) == 8192
        print("OK")
    """,
    )


def test_pipe_and_socket_descriptors_are_refused_not_hung(aio, engine, tmp_path):
    run_child(
        engine,
        tmp_path,
        """
        r, w = os.pipe()
        a, b = socket.socketpair()
        with AsyncIOHandle(engine=engine) as h:
            t = torch.zeros(1 << 16, dtype=torch.uint8)
            expect_errno(lambda: h.read(t, r), errno.ESPIPE)   # empty pipe: a read would block forever
            expect_errno(lambda: h.write(t, w), errno.ESPIPE)
            expect_errno(lambda: h.read(t, a.fileno()), errno.ESPIPE)
            expect_errno(lambda: h.write(t, b.fileno()), errno.ESPIPE)
        print("OK")
    """,
    )


def test_unix_socket_path_is_refused(aio, engine, tmp_path):
    run_child(
        engine,
        tmp_path,
        """
        path = os.path.join(folder, "sock")
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.listen()
        with AsyncIOHandle(engine=engine) as h:
            t = torch.zeros(4096, dtype=torch.uint8)
            expect_errno(lambda: h.read(t, path), errno.ESPIPE)
            expect_errno(lambda: h.write(t, path), errno.ESPIPE)
        print("OK")
    """,
    )


def test_character_devices_behave_like_files(aio, engine, tmp_path):
    run_child(
        engine,
        tmp_path,
        """
        with AsyncIOHandle(engine=engine) as h:
            t = torch.arange(100_003, dtype=torch.float32)
            assert h.write(t, "/dev/null") == t.nbytes                    # no truncate of a device (was EINVAL)
            assert h.write(t, "/dev/null", 12345, truncate=True) == t.nbytes
            fd = os.open("/dev/null", os.O_WRONLY)
            assert h.write(t, fd) == t.nbytes
            os.close(fd)
            z = torch.ones(100_003, dtype=torch.float32)
            assert h.read(z, "/dev/zero", 777) == z.nbytes and not z.any()
            expect_errno(lambda: h.read(z, "/dev/null"), errno.ENODATA)  # an empty file: nothing to read
            expect_errno(lambda: h.write(t, "/dev/full"), errno.ENOSPC)
        print("OK")
    """,
    )


def test_unaligned_read_into_read_only_memory_raises_not_crashes(aio, engine, tmp_path):
    run_child(
        engine,
        tmp_path,
        """
        warnings.simplefilter("ignore")  # torch.frombuffer warns that the buffer is not writable
        n = 4 << 20
        src = os.path.join(folder, "src.bin")
        with open(src, "wb") as f:
            f.write(os.urandom(n + 8192))
        f = open(src, "rb")
        ro = mmap.mmap(f.fileno(), n + 8192, prot=mmap.PROT_READ)
        whole = torch.frombuffer(ro, dtype=torch.uint8)
        with AsyncIOHandle(engine=engine) as h:
            for start, length in ((1, n), (4096, n), (3, 5000)):  # misaligned (bounce), aligned, head/tail only
                dst = whole[start:start + length]
                e = expect_errno(lambda: h.read(dst, src, 0), errno.EFAULT)
                assert src in str(e), e
            ok = torch.empty(n + 1, dtype=torch.uint8)[1:]   # and writable misaligned memory still works
            assert h.read(ok, src) == n and bytes(ok.numpy()) == ro[:n]
        print("OK")
    """,
    )


FORK_PRELUDE = """
def child(fn):
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)  # torch's OpenMP pool does not survive fork (DataLoader workers do the same)
        try:
            status = fn()
        except BaseException as e:
            print("child failed:", repr(e), flush=True)
            status = 3
        sys.stdout.flush()
        os._exit(status or 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
"""


def test_handle_used_in_forked_child_works(aio, engine, tmp_path):
    run_child(
        engine,
        tmp_path,
        prelude=FORK_PRELUDE,
        body="""
        h = AsyncIOHandle(engine=engine)
        t = torch.arange(1 << 20, dtype=torch.int32)
        h.write(t, os.path.join(folder, "parent.bin"))

        def use():
            out = os.path.join(folder, "child.bin")
            assert h.write(t * 2, out) == t.nbytes
            back = torch.empty_like(t)
            h.read(back, out)
            assert torch.equal(back, t * 2)
            h.read(back, os.path.join(folder, "parent.bin"))
            assert torch.equal(back, t)
            h.close()
            return 0

        assert child(use) == 0
        assert h.read(torch.empty_like(t), os.path.join(folder, "child.bin")) == t.nbytes  # parent unaffected
        h.close()
        print("OK")
    """,
    )


def test_child_exiting_while_parent_has_transfers_in_flight_does_not_hang(aio, engine, tmp_path):
    run_child(
        engine,
        tmp_path,
        prelude=FORK_PRELUDE,
        body="""
        h = AsyncIOHandle(engine=engine)
        big = torch.ones(32 << 20, dtype=torch.uint8)
        reqs = [h.write_async(big, os.path.join(folder, f"w{i}.bin")) for i in range(4)]

        def wait_parents():
            try:
                reqs[0].wait()
            except RuntimeError as e:      # a clear error: the transfer belongs to the parent
                assert "fork" in str(e), e
                return 0
            return 1

        assert child(wait_parents) == 0
        pid = os.fork()
        if pid == 0:
            sys.exit(0)                    # runs the atexit hooks, which must not wait for the parent's transfers
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for r in reqs:
            assert r.wait() == big.nbytes
        print("OK")
    """,
    )


def test_multiprocessing_fork_workers_use_a_global_handle(aio, tmp_path):
    run_child(
        "posix",
        tmp_path,
        """
        import multiprocessing as mp
        h = AsyncIOHandle()
        h.write(torch.arange(1000, dtype=torch.int64), os.path.join(folder, "base.bin"))

        def work(i):
            torch.set_num_threads(1)
            t = torch.empty(1000, dtype=torch.int64)
            h.read(t, os.path.join(folder, "base.bin"))
            h.write(t + i, os.path.join(folder, f"out{i}.bin"))
            return int(t.sum())

        if __name__ == "__main__":
            with mp.get_context("fork").Pool(2) as pool:
                assert pool.map(work, range(4)) == [499500] * 4
            for i in range(4):
                t = torch.empty(1000, dtype=torch.int64)
                h.read(t, os.path.join(folder, f"out{i}.bin"))
                assert torch.equal(t, torch.arange(1000) + i)
            print("OK")
    """,
    )
