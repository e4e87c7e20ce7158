"""Each async-IO engine against fio: sequential write and read of one file (default 1 GiB) with 1 MiB blocks, queue
depth 32, O_DIRECT, interleaved round by round (ours and fio back to back, alternating who goes first), median of
the per-pair ratios. fio runs with the same file, block size, queue depth, direct=1, ioengine=libaio, one job.

    python benchmarks/engines_vs_fio.py [--path DIR] [--size 1G] [--rounds 5] [--json PATH]

``--json PATH`` also writes the ratios for ``benchmarks/plot.py``, each against the 0.95 x fio target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict

from common import ratio_row, run_main, write_json

from deepoffload.bench.fio import fio_executable, run_fio
from deepoffload.bench.measure import OPS, BenchError, make_buffer, scratch_file, time_transfer
from deepoffload.bench.sizes import format_size, parse_size
from deepoffload.diagnostics import direct_io_works
from deepoffload.io.engines import engine_status
from deepoffload.io.handle import AsyncIOHandle

TARGET = 0.95  # x fio, the project's target for each engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument("--size", type=parse_size, default="1G", help="bytes per transfer (default 1G)")
    parser.add_argument("--block-size", type=parse_size, default="1M")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON (benchmarks/plot.py)")
    args = parser.parse_args()
    fio_executable()
    engines = [e for e, (ok, _) in engine_status().items() if ok]
    buffer = make_buffer(args.size, "pinned")
    gbps: dict[tuple[str, str, str], list[float]] = defaultdict(list)  # (engine, op, who) -> GB/s per round
    with scratch_file(args.path, args.size) as path:
        if not direct_io_works(path):
            raise BenchError(f"{args.path} refuses O_DIRECT; pick a folder on a real disk")
        handles = {
            e: AsyncIOHandle(engine=e, block_size=args.block_size, queue_depth=args.queue_depth, intra_op_parallelism=1)
            for e in engines
        }
        handles[engines[0]].write(buffer, path)  # lay the file out
        for r in range(args.rounds):
            for op in OPS:
                for engine in engines:
                    ours = lambda: time_transfer(handles[engine], op, buffer, path, True)  # noqa: E731
                    fio = lambda: run_fio(path, op, args.size, args.block_size, args.queue_depth, 1)  # noqa: E731
                    for who, step in (("ours", ours), ("fio", fio)) if r % 2 == 0 else (("fio", fio), ("ours", ours)):
                        gbps[engine, op, who].append(step().gbps)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        for handle in handles.values():
            handle.close()
    print(
        f"engines vs fio: {format_size(args.size)} per transfer, {format_size(args.block_size)} blocks, queue depth "
        f"{args.queue_depth}, O_DIRECT, {args.rounds} rounds interleaved; GB/s = 1e9 bytes/s"
    )
    print(f"{'engine':<10}{'op':<7}{'ours GB/s':>11}{'fio GB/s':>10}{'ours/fio':>10}   per-round ratios")
    for op in OPS:
        for engine in engines:
            print(ratio_row(f"{engine:<10}{op:<7}", gbps[engine, op, "ours"], gbps[engine, op, "fio"], (11, 10, 10)))
    if args.json:
        results = []
        for op in OPS:
            for engine in engines:
                ratios = [a / b for a, b in zip(gbps[engine, op, "ours"], gbps[engine, op, "fio"])]
                results.append(
                    {
                        "label": f"{engine} {op} / fio",
                        "value": round(statistics.median(ratios), 3),
                        "bound": TARGET,
                        "per_round": [round(r, 3) for r in ratios],
                    }
                )
        write_json(
            args.json,
            "engines_vs_fio",
            f"Engines against fio: {format_size(args.size)}, "
            f"{format_size(args.block_size)} blocks, queue depth {args.queue_depth}, O_DIRECT",
            results,
        )
    return 0


if __name__ == "__main__":
    run_main("engines_vs_fio", main)
