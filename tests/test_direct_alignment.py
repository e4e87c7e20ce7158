"""Buffers at 1 KiB (not page) boundaries, as DeepSpeed lays out its parameter swap buffers, go straight to O_DIRECT
IO where the file system's direct-IO memory alignment (``statx`` STATX_DIOALIGN) allows it: the handle reads and
writes the caller's memory, no bounce buffer. Proven on the system calls themselves: the transfer runs under
``strace`` on the portable engine (one ``pread64``/``pwrite64`` per block, the buffer address in the call)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (apt-get install strace)")

NBYTES = 1 << 20
CHILD = """
import json, sys, torch
from deepoffload.op_builder import AsyncIOBuilder
folder, out = sys.argv[1], {}
h = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1, engine="posix")
example = torch.empty(0, dtype=torch.uint8)
n = 1 << 20
for shift in map(int, sys.argv[2:]):
    src = h.new_cpu_locked_tensor(n + 4096, example).narrow(0, shift, n)
    dst = h.new_cpu_locked_tensor(n + 4096, example).narrow(0, shift, n)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(shift)))
    path = f"{folder}/shift{shift}.bin"
    h.async_pwrite(src, path, 0); h.wait()
    h.async_pread(dst, path, 0); h.wait()
    out[shift] = {"src": src.data_ptr(), "dst": dst.data_ptr(), "equal": torch.equal(src, dst)}
print(json.dumps(out))
"""
CALL = re.compile(r"(pread64|pwrite64)\(0x[0-9a-f]+, (0x[0-9a-f]+), (0x[0-9a-f]+), ")


@pytest.fixture(scope="module")
def traced(aio, tmp_path_factory) -> tuple[int, dict, dict[str, list[tuple[int, int]]]]:
    """Runs CHILD (a 1 KiB shift, then a 4-byte one) under strace on a disk that takes O_DIRECT. Returns the
    file system's direct-IO memory alignment, the child's buffers, and the (address, length) of every
    pread64/pwrite64 the process made."""
    base = os.environ.get("DEEPOFFLOAD_TEST_DIR")
    folder = Path(tempfile.mkdtemp(dir=base, prefix="dio-")) if base else tmp_path_factory.mktemp("dio")
    memory, _offset, supported = aio.dio_alignment(str(folder))
    if not supported:
        pytest.skip(f"{folder}: the file system does not support O_DIRECT")
    trace = folder / "trace.txt"
    try:
        proc = subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-o", str(trace), "-e",
                               "trace=pread64,pwrite64", "-e", "raw=pread64,pwrite64", sys.executable, "-c", CHILD,
                               str(folder), "1024", "4"], capture_output=True, text=True, timeout=300)
        text = trace.read_text() if trace.exists() else ""
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if proc.returncode and "ptrace" in proc.stderr and not text:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    calls: dict[str, list[tuple[int, int]]] = {"pread64": [], "pwrite64": []}
    for m in CALL.finditer(text):
        calls[m.group(1)].append((int(m.group(2), 16), int(m.group(3), 16)))
    return memory, result, calls


def inside(calls: list[tuple[int, int]], start: int) -> int:
    """Bytes those calls moved to or from [start, start + NBYTES)."""
    return sum(length for address, length in calls if start <= address < start + NBYTES)


def test_one_kib_aligned_buffers_are_not_bounced(traced):
    memory, result, calls = traced
    if 1024 % memory:
        pytest.skip(f"statx reports {memory}-byte direct-IO memory alignment here: 1 KiB buffers bounce")
    r = result["1024"]
    assert r["src"] % 4096 == 1024 and r["dst"] % 4096 == 1024 and r["equal"]
    assert inside(calls["pwrite64"], r["src"]) == NBYTES  # written from the caller's memory
    assert inside(calls["pread64"], r["dst"]) == NBYTES  # read into it


def test_misaligned_buffers_are_bounced(traced):
    """The control: memory the kernel cannot take directly goes through an aligned bounce buffer."""
    _memory, result, calls = traced
    r = result["4"]
    assert r["equal"]
    assert inside(calls["pwrite64"], r["src"]) == 0 and inside(calls["pread64"], r["dst"]) == 0
