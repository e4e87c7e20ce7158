"""Running fio on the same file and settings as our own transfers, and reading its JSON output."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .measure import BenchError, Sample

INSTALL_HINT = (
    "fio is not installed (or not on PATH): install it with `apt-get install fio` (Debian/Ubuntu), "
    "`dnf install fio` (Fedora/RHEL) or `brew install fio`, or leave out --compare-fio"
)


def fio_executable() -> str:
    """The path of fio on PATH; ``BenchError`` saying how to get it when there is none."""
    path = shutil.which("fio")
    if path is None:
        raise BenchError(INSTALL_HINT)
    return path


def fio_command(
    fio: str, path: Path, op: str, nbytes: int, block_size: int, queue_depth: int, threads: int
) -> tuple[list[str], int]:
    """(argv, bytes moved) for one sequential ``op`` over the first ``nbytes`` of ``path`` with O_DIRECT and libaio.

    Like ``intra_op_parallelism``, ``threads`` jobs each take one contiguous part; each part is a whole number of
    blocks, so up to ``threads * block_size - 1`` bytes at the end may be left out.

    Args:
        fio: The fio executable.
        path: The test file.
        op: fio's ``--rw``: ``read`` or ``write``.
        nbytes: The bytes to move, at most.
        block_size: The request size in bytes (``--bs``).
        queue_depth: Requests in flight per job (``--iodepth``).
        threads: The number of fio jobs (``--numjobs``).

    Returns:
        fio's command line and the bytes it moves (all jobs together).

    Raises:
        BenchError: When ``nbytes`` does not give each job a whole block.
    """
    per_job = nbytes // threads // block_size * block_size
    if per_job == 0:
        raise BenchError(
            f"--size {nbytes} is too small to give each of {threads} fio jobs a {block_size}-byte "
            f"block; pass a larger --size"
        )
    argv = [
        fio,
        "--name=deepoffload-bench",
        f"--filename={path}",
        f"--rw={op}",
        f"--bs={block_size}",
        f"--iodepth={queue_depth}",
        "--direct=1",
        "--ioengine=libaio",
        f"--numjobs={threads}",
        f"--size={per_job}",
        f"--offset_increment={per_job}",
        "--group_reporting",
        "--output-format=json",
    ]
    return argv, per_job * threads


def parse_fio_json(text: str, op: str) -> float:
    """Throughput of ``op`` in bytes per second from fio's ``--output-format=json`` output.

    The value is ``jobs[0].<op>.bw_bytes``: the whole group with ``--group_reporting``. Text before the JSON document
    (fio's warnings) is skipped.

    Args:
        text: fio's standard output.
        op: ``read`` or ``write``.

    Returns:
        The throughput in bytes per second.

    Raises:
        BenchError: When the output holds no such value, or it is not positive.
    """
    start = text.find("{")
    try:
        data: Any = json.loads(text[start:]) if start >= 0 else None  # None (no JSON): a TypeError below
        bw = float(data["jobs"][0][op]["bw_bytes"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"could not read fio's {op} throughput from its JSON output ({type(e).__name__}: {e})") from e
    if bw <= 0:
        raise BenchError(f"fio reported no {op} throughput (bw_bytes={bw}); run it by hand to see why")
    return bw


def run_fio(
    path: Path, op: str, nbytes: int, block_size: int, queue_depth: int, threads: int, timeout_s: float = 600.0
) -> Sample:
    """Run fio once and return its transfer as a ``Sample`` (seconds = bytes / fio's reported throughput).

    Args:
        path: The test file.
        op: ``read`` or ``write``.
        nbytes: The bytes to move, at most (see ``fio_command``).
        block_size: The request size in bytes.
        queue_depth: Requests in flight per job.
        threads: The number of fio jobs.
        timeout_s: How long fio may run.

    Returns:
        The transfer, with tool ``fio``.

    Raises:
        BenchError: When fio is missing, times out, fails or reports no throughput.
    """
    argv, moved = fio_command(fio_executable(), path, op, nbytes, block_size, queue_depth, threads)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"fio did not finish within {timeout_s:.0f} s") from e
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()
        raise BenchError(f"fio failed (exit {done.returncode}): {last[-1] if last else 'no output'}")
    bw = parse_fio_json(done.stdout, op)
    return Sample("fio", op, moved, moved / bw, block_size)
