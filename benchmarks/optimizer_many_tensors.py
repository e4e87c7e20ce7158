"""Many small tensors: an Adam step over 10,000 parameters of 32 elements, in memory and offloaded, interleaved
A B A B on the shared disk (medians and ratio printed); then the offloaded run's files, disk use (allocated blocks)
against the state's bytes, and the time ``close()`` takes.

    python benchmarks/optimizer_many_tensors.py [--params 10000] [--numel 32] [--rounds 5] [--folder DIR]

Target: offloaded step <= 1.5 x the in-memory step, a handful of files, disk use <= 1.1 x state bytes (plus
alignment), close() under 1 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def make_params(count: int, numel: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen)
    return params


def disk_use(folder: str) -> tuple[int, int]:
    """(files, bytes allocated on disk) under ``folder``."""
    files = allocated = 0
    for root, _, names in os.walk(folder):
        for name in names:
            files += 1
            allocated += os.stat(os.path.join(root, name)).st_blocks * 512
    return files, allocated


def main() -> None:
    import torch

    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000)
    parser.add_argument("--numel", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--folder", default=None, help="base folder for swap files (default: a temp folder here)")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="many-tensors-", dir=args.folder or os.getcwd())
    plain_params, off_params = make_params(args.params, args.numel), make_params(args.params, args.numel)
    plain = torch.optim.Adam(plain_params, lr=1e-3)
    offloaded = OffloadedOptimizer(torch.optim.Adam, off_params, SwapConfig(folder=base), lr=1e-3)
    plain.step(), offloaded.step()  # first steps create the state
    times: dict[str, list[float]] = {"in memory": [], "offloaded": []}
    for _ in range(args.rounds):
        for name, opt in (("in memory", plain), ("offloaded", offloaded)):
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    identical = all(torch.equal(a, b) for a, b in zip(plain_params, off_params))
    state = sum(t.numel() * t.element_size() for s in plain.state.values() for t in s.values() if torch.is_tensor(t))
    files, allocated = disk_use(base)
    start = time.perf_counter()
    offloaded.close()
    closing = time.perf_counter() - start
    os.rmdir(base)
    m = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.params} parameters of {args.numel} elements, Adam, {args.rounds} interleaved rounds")
    for name, value in m.items():
        print(f"  {name:10s} step: median {value * 1e3:8.1f} ms  (min {min(times[name]) * 1e3:.1f} ms)")
    print(f"  offloaded / in memory: {m['offloaded'] / m['in memory']:.2f}x  (parameters identical: {identical})")
    print(
        f"  files: {files}; on disk: {allocated:,} bytes for {state:,} bytes of state "
        f"({allocated / state:.2f}x); close(): {closing:.3f} s"
    )


if __name__ == "__main__":
    main()
