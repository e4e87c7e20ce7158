"""What many small ops cost against one large op: N async ops of S bytes submitted back to back and then waited,
against the same N*S bytes as ONE op, write then read, same handle (intra_op_parallelism 1 by default), O_DIRECT
where the folder allows it, ops at offsets 0, S, 2S, ... of one file. Two small-op variants: `separate` gives each op
its own page-aligned, page-locked buffer (``aligned_empty``, as an optimizer's per-tensor buffers), `slices` uses
S-byte views of the large op's buffer (same memory as the large op: only the op count differs).
Per engine and case, the three variants are timed interleaved round by round (rotating which goes first); printed:
the median of the per-round throughput ratios small/large (1.0 = small ops as fast as one op).

    python benchmarks/small_ops.py [--path DIR] [--cases 64x8M,256x1M] [--rounds 5] [--engines all]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import run_main

from deepoffload.bench.measure import OPS, BenchError, evict, make_buffer, scratch_file
from deepoffload.bench.sizes import format_size, parse_size
from deepoffload.config import AioConfig
from deepoffload.diagnostics import direct_io_works
from deepoffload.io.engines import engine_status
from deepoffload.io.handle import AsyncIOHandle


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"64x8M,256x1M"`` -> [(64, 8 MiB), (256, 1 MiB)]: (number of ops, bytes per op)."""
    cases = []
    for item in text.split(","):
        count, _, size = item.partition("x")
        if not count.isdigit() or not size:
            raise BenchError(f"--cases takes COUNTxSIZE items separated by commas (e.g. 64x8M), got {item!r}")
        cases.append((int(count), parse_size(size)))
    return cases


def time_ops(handle: AsyncIOHandle, op: str, buffers: list[torch.Tensor], path: Path, direct: bool) -> float:
    """Seconds to move ``buffers`` (one op each, back to back at consecutive offsets of ``path``) and wait for all.
    Writes overwrite in place; before a read the file's cached pages are evicted (not timed)."""
    if op == "read":
        evict(path)
    start = time.perf_counter()
    offset = 0
    requests = []
    for buffer in buffers:
        if op == "write":
            requests.append(handle.write_async(buffer, path, offset, truncate=False, fsync=not direct))
        else:
            requests.append(handle.read_async(buffer, path, offset))
        offset += buffer.numel()
    for request in requests:
        request.wait()
    return time.perf_counter() - start


def measure(engine: str, count: int, size: int, args: argparse.Namespace) -> None:
    """Prints, per op, the medians of the per-round throughput ratios small/large of both small-op variants."""
    large = make_buffer(count * size, "pinned")
    variants = {
        "separate": [make_buffer(size, "pinned") for _ in range(count)],
        "slices": [large[i * size : (i + 1) * size] for i in range(count)],
        "large": [large],
    }
    names = list(variants)
    ratios = {(op, name): [] for op in OPS for name in ("separate", "slices")}
    with (
        scratch_file(args.path, count * size) as path,
        AsyncIOHandle(engine=engine, intra_op_parallelism=args.threads) as handle,
    ):
        direct = direct_io_works(path)
        handle.write(large, path)  # lay the file out
        for r in range(args.rounds):
            order = names[r % 3 :] + names[: r % 3]
            for op in OPS:
                seconds = {name: time_ops(handle, op, variants[name], path, direct) for name in order}
                for name in ("separate", "slices"):
                    ratios[op, name].append(seconds["large"] / seconds[name])
    line = f"  {engine:<9}{count:>5} x {format_size(size):<8} {'O_DIRECT' if direct else 'buffered':<9}"
    for op in OPS:
        for name in ("separate", "slices"):
            line += f"  {op}/{name} {statistics.median(ratios[op, name]):.3f}"
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument(
        "--cases",
        type=parse_cases,
        default="64x8M,256x1M",
        help="COUNTxSIZE items: COUNT ops of SIZE bytes (default 64x8M,256x1M)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra_op_parallelism (default 1)")
    parser.add_argument("--engines", default="all", help="comma-separated engine names, or 'all' that work here")
    args = parser.parse_args()
    status = engine_status()
    engines = [e for e, (ok, _) in status.items() if ok] if args.engines == "all" else args.engines.split(",")
    config = AioConfig()
    print(
        f"small ops vs one op: block_size {config.block_size} bytes, queue depth {config.queue_depth}, "
        f"intra_op_parallelism {args.threads}, {args.rounds} rounds interleaved; "
        f"median of per-round throughput ratios small/large"
    )
    for engine in engines:
        for count, size in args.cases:
            measure(engine, count, size, args)
    return 0


if __name__ == "__main__":
    run_main("small_ops", main)
