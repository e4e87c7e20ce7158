"""Buffers at 1 KiB (not page) boundaries, as DeepSpeed lays out its parameter swap buffers, go straight to O_DIRECT
IO where the file system's direct-IO memory alignment (``statx`` STATX_DIOALIGN) allows it: the handle reads and
writes the caller's memory, no bounce buffer. And handles with blocks below 4096 bytes do their direct IO in
4096-byte blocks. Proven on the system calls themselves: the transfers run under ``strace`` on the portable engine
(one ``pread64``/``pwrite64`` per block, the buffer address and length in the call)."""

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
example = torch.empty(0, dtype=torch.uint8)
n = 1 << 20
for spec in sys.argv[2:]:  # SHIFT:BLOCK_SIZE
    shift, block_size = map(int, spec.split(":"))
    h = AsyncIOBuilder().load().aio_handle(block_size=block_size, queue_depth=8, intra_op_parallelism=1,
                                           engine="posix")
    src = h.new_cpu_locked_tensor(n + 4096, example).narrow(0, shift, n)
    dst = h.new_cpu_locked_tensor(n + 4096, example).narrow(0, shift, n)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(shift)))
    path = f"{folder}/{shift}-{block_size}.bin"
    h.async_pwrite(src, path, 0); h.wait()
    h.async_pread(dst, path, 0); h.wait()
    out[spec] = {"src": src.data_ptr(), "dst": dst.data_ptr(), "equal": torch.equal(src, dst)}
print(json.dumps(out))
"""
CALL = re.compile(r"(pread64|pwrite64)\(0x[0-9a-f]+, (0x[0-9a-f]+), (0x[0-9a-f]+), ")


@pytest.fixture(scope="module")
def traced(aio, tmp_path_factory) -> tuple[int, dict, dict[str, list[tuple[int, int]]]]:
    """Runs CHILD (1 MiB blocks from buffers shifted 1 KiB and 4 bytes from a page, then 1 KiB blocks) under strace
    on a disk that takes O_DIRECT. Returns the
    file system's direct-IO memory alignment, the child's buffers, and the (address, length) of every
    pread64/pwrite64 the process made."""
    base = os.environ.get("DEEPOFFLOAD_TEST_DIR")
    folder = Path(tempfile.mkdtemp(dir=base, prefix="dio-")) if base else tmp_path_factory.mktemp("dio")
    memory, _offset, supported = aio.dio_alignment(str(folder))
    if not supported:
        pytest.skip(f"{folder}: the file system does not support O_DIRECT")
    trace = folder / "trace.txt"
    try:
        proc = subprocess.run(
            [
                "strace",
                "-f",
                "-qq",
                "--seccomp-bpf",
                "-o",
                str(trace),
                "-e",
                "trace=pread64,pwrite64",
                "-e",
                "raw=pread64,pwrite64",
                sys.executable,
                "-c",
                CHILD,
                str(folder),
                "1024:1048576",
                "4:1048576",
                "0:1024",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
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


def lengths(calls: list[tuple[int, int]], start: int) -> set[int]:
    """The lengths of those calls in [start, start + NBYTES)."""
    return {length for address, length in calls if start <= address < start + NBYTES}


def test_one_kib_aligned_buffers_are_not_bounced(traced):
    memory, result, calls = traced
    if 1024 % memory:
        pytest.skip(f"statx reports {memory}-byte direct-IO memory alignment here: 1 KiB buffers bounce")
    r = result["1024:1048576"]
    assert r["src"] % 4096 == 1024 and r["dst"] % 4096 == 1024 and r["equal"]
    assert inside(calls["pwrite64"], r["src"]) == NBYTES  # written from the caller's memory
    assert inside(calls["pread64"], r["dst"]) == NBYTES  # read into it


def test_misaligned_buffers_are_bounced(traced):
    """The control: memory the kernel cannot take directly goes through an aligned bounce buffer."""
    _memory, result, calls = traced
    r = result["4:1048576"]
    assert r["equal"]
    assert inside(calls["pwrite64"], r["src"]) == 0 and inside(calls["pread64"], r["dst"]) == 0


def test_block_sizes_below_4096_do_direct_io_in_4096_byte_blocks(traced):
    """DeepSpeed's tests use 1 KiB handles: get_block_size() says 1024, the IO underneath uses whole pages."""
    _memory, result, calls = traced
    r = result["0:1024"]
    assert r["equal"] and r["src"] % 4096 == 0
    assert inside(calls["pwrite64"], r["src"]) == NBYTES and lengths(calls["pwrite64"], r["src"]) == {4096}
    assert inside(calls["pread64"], r["dst"]) == NBYTES and lengths(calls["pread64"], r["dst"]) == {4096}
