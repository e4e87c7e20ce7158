"""What the bounce path costs: throughput of an unaligned buffer (one byte past a torch allocation, so every
transfer is staged through the handle's aligned bounce buffers) against a page-aligned, page-locked one, same handle,
same file, interleaved round by round (alternating which goes first), median of the per-round ratios.

    python benchmarks/bounce_buffer.py [--path DIR] [--size 1G] [--rounds 5] [--engine auto]
"""

from __future__ import annotations

import argparse
import tempfile

from common import ratio_row, run_main

from deepoffload.bench.measure import OPS, make_buffer, scratch_file, time_transfer
from deepoffload.bench.sizes import format_size, parse_size
from deepoffload.diagnostics import direct_io_works
from deepoffload.io.handle import AsyncIOHandle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument("--size", type=parse_size, default="1G", help="bytes per transfer (default 1G)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", default="auto")
    args = parser.parse_args()
    buffers = {kind: make_buffer(args.size, kind) for kind in ("pinned", "unaligned")}
    gbps: dict[tuple[str, str], list[float]] = {(kind, op): [] for kind in buffers for op in OPS}
    with scratch_file(args.path, args.size) as path, AsyncIOHandle(engine=args.engine) as handle:
        direct = direct_io_works(path)
        handle.write(buffers["pinned"], path)  # lay the file out
        for r in range(args.rounds):
            for op in OPS:
                for kind in ("pinned", "unaligned") if r % 2 == 0 else ("unaligned", "pinned"):
                    gbps[kind, op].append(time_transfer(handle, op, buffers[kind], path, direct).gbps)
        print(
            f"bounce buffer: {format_size(args.size)} per transfer, engine {handle.engine}, "
            f"{handle.config.block_size}-byte blocks, queue depth {handle.config.queue_depth}, "
            f"{'O_DIRECT' if direct else 'buffered'}, "
            f"{args.rounds} rounds interleaved; GB/s = 1e9 bytes/s"
        )
    print(f"{'op':<7}{'unaligned GB/s':>14}{'aligned GB/s':>16}{'unaligned/aligned':>19}   per-round ratios")
    for op in OPS:
        print(ratio_row(f"{op:<7}", gbps["unaligned", op], gbps["pinned", op], (14, 16, 19)))
    return 0


if __name__ == "__main__":
    run_main("bounce_buffer", main)
