"""Our best engine against the reference, DeepSpeed 0.19.8's aio handle: sequential write and read of one file (default
1 GiB), 1 MiB blocks, queue depth 32, one thread, interleaved round by round (alternating which handle goes first),
median of the per-round ratios ours/reference.

Both handles use ONE buffer: DeepSpeed's own page-locked ``new_cpu_locked_tensor`` (page-aligned, so ours takes its
zero-copy path too). Separate buffers showed a 5-10 % bias by allocation order, and DeepSpeed stages any buffer it did
not allocate through a fresh bounce buffer, so a buffer shared across processes would handicap it; hence both
handles run in one process: the reference venv's interpreter (``--reference-python``, same torch version as ours),
importing deepoffload from this checkout. The reference venv is set up apart from ours:

    python3 -m venv /work/dsvenv && /work/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8
    python benchmarks/vs_deepspeed.py --reference-python /work/dsvenv/bin/python [--path DIR] [--size 1G] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _import_checkout() -> None:
    """Make ``deepoffload`` importable from this checkout without installing anything into the reference venv
    (``import deepoffload`` then provides ``deepoffload.op_builder`` from ``op_builder/`` itself)."""
    sys.path.insert(0, str(ROOT))


def measure(args: argparse.Namespace) -> int:
    """Runs inside the reference interpreter: both handles, one buffer, interleaved."""
    _import_checkout()
    import torch
    from common import ratio_row
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from deepoffload.bench.measure import OPS, evict, scratch_file, time_transfer
    from deepoffload.bench.sizes import format_size
    from deepoffload.diagnostics import direct_io_works
    from deepoffload.io.handle import AsyncIOHandle

    block, depth = args.block_size, args.queue_depth
    reference = AsyncIOBuilder().load().aio_handle(block, depth, False, True, 1)
    buffer = reference.new_cpu_locked_tensor(args.size, torch.empty(0, dtype=torch.uint8))
    buffer.copy_(torch.randint(0, 256, (args.size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    ours = AsyncIOHandle(
        engine=args.engine,
        block_size=block,
        queue_depth=depth,
        intra_op_parallelism=1,
        single_submit=False,
        overlap_events=True,
    )

    def timed_reference(op: str, path: Path) -> float:
        if op == "read":
            evict(path)
        start = time.perf_counter()
        done = (reference.sync_pread if op == "read" else reference.sync_pwrite)(buffer, str(path))
        seconds = time.perf_counter() - start
        if done < 0:
            raise OSError(f"DeepSpeed {op} of {path} returned {done}")
        return args.size / seconds / 1e9

    gbps: dict[tuple[str, str], list[float]] = {(who, op): [] for who in ("ours", "reference") for op in OPS}
    with scratch_file(args.path, args.size) as path:
        direct = direct_io_works(path)
        ours.write(buffer, path)  # lay the file out
        for r in range(args.rounds):
            for op in OPS:
                steps = {
                    "ours": lambda: time_transfer(ours, op, buffer, path, direct).gbps,
                    "reference": lambda: timed_reference(op, path),
                }
                for who in ("ours", "reference") if r % 2 == 0 else ("reference", "ours"):
                    gbps[who, op].append(steps[who]())
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    ours.close()
    print(
        f"ours ({ours.engine}) vs DeepSpeed 0.19.8 aio_handle: {format_size(args.size)} per transfer, "
        f"{format_size(block)} blocks, queue depth {depth}, 1 thread, one shared page-locked buffer, "
        f"{'O_DIRECT' if direct else 'buffered'}, {args.rounds} rounds interleaved; GB/s = 1e9 bytes/s"
    )
    print(f"{'op':<7}{'ours GB/s':>11}{'reference GB/s':>16}{'ours/reference':>16}   per-round ratios")
    for op in OPS:
        print(ratio_row(f"{op:<7}", gbps["ours", op], gbps["reference", op], (11, 16, 16)), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--reference-python",
        required=True,
        metavar="PYTHON",
        help="python of a venv with deepspeed==0.19.8 and the same torch version as ours",
    )
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument("--size", default="1G", help="bytes per transfer (K/M/G suffixes; default 1G)")
    parser.add_argument("--block-size", default="1M")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", default="auto", help="our engine (default: the best that works here)")
    parser.add_argument("--in-reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.in_reference:  # re-run this script in the reference interpreter
        if not os.access(args.reference_python, os.X_OK):
            print(
                f"vs_deepspeed: error: {args.reference_python} is not an executable python; create the reference "
                f"venv as this script's docstring says",
                file=sys.stderr,
            )
            return 1
        argv = [args.reference_python, str(Path(__file__).resolve()), *sys.argv[1:], "--in-reference"]
        return subprocess.run(argv).returncode
    _import_checkout()
    from deepoffload.bench.sizes import parse_size

    args.size, args.block_size = parse_size(args.size), parse_size(args.block_size)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
