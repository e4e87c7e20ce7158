"""Optimizer step with about 1 GB of Adam state: in memory, offloaded (OffloadedOptimizer, with torch's thread
setting and with ``compute_threads`` leaving one core to the IO threads), and the pure IO of the same bytes through
the async-IO handle (write then read back the state, the same chunk sizes); interleaved A B C D A B C D on the
shared disk, medians (and best-of, less sensitive to other users of the machine) and ratios printed. Then peak RSS
of short offloaded and in-memory training runs for two model sizes, each in a fresh process (VmHWM; ru_maxrss where
/proc is missing), against the target "in memory minus the state plus 1.1 x (the staging pool and one more of its
buffers)": the pool as the offloaded run grew it (``--rss-numel 16777216``: parameters whose state exceeds
``chunk_bytes``, so the pool's buffers grow to hold one), and the heap growth a step lets pass before it trims.

    python benchmarks/optimizer_offload.py [--state-gb 1.0] [--rounds 3] [--folder DIR] [--rss-sizes 0.25,1,4]
        [--rss-numel N] [--rss-only] [--checksum]

Target: offloaded <= 1.15 x max(in-memory step, IO time); offloaded peak RSS must not grow with the model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

TENSOR_NUMEL = 1 << 20  # 4 MiB fp32 parameters


def param_count(state_bytes: int, numel: int) -> int:
    return max(1, round(state_bytes / (8 * numel)))  # Adam: exp_avg + exp_avg_sq, 8 bytes per element


def make_params(state_bytes: int, numel: int = TENSOR_NUMEL):
    import torch

    params = []
    for i in range(param_count(state_bytes, numel)):
        p = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(i)))
        p.grad = torch.randn(numel, generator=torch.Generator().manual_seed(10_000 + i))
        params.append(p)
    return params


def io_only(handle, folder: str, state_bytes: int, chunk_bytes: int) -> float:
    """Seconds to write ``state_bytes`` as chunk files and read them back, reads of chunk k+1 overlapping the write
    of chunk k as in the optimizer's pipeline."""
    from deepoffload.io.buffers import aligned_empty

    chunks = max(1, state_bytes // chunk_bytes)
    buffers = [aligned_empty(chunk_bytes) for _ in range(3)]
    for b in buffers:
        b.fill_(1)
    files = [os.path.join(folder, f"io{k}.bin") for k in range(chunks)]
    for f in files:  # the files exist, as the optimizer's do after its first step
        handle.write(buffers[0], f)
    start = time.perf_counter()
    reads = [handle.read_async(buffers[0], files[0])]
    writes = []
    for k in range(chunks):
        if k + 1 < chunks:
            reads.append(handle.read_async(buffers[(k + 1) % 3], files[k + 1]))
        reads.pop(0).wait()
        writes.append(handle.write_async(buffers[k % 3], files[k]))
        if len(writes) > 1:
            writes.pop(0).wait()
    for w in writes:
        w.wait()
    seconds = time.perf_counter() - start
    for f in files:
        os.unlink(f)
    return seconds


def step_times(state_gb: float, rounds: int, folder: str, checksum: bool = False) -> None:
    import torch

    from deepoffload.io.handle import AsyncIOHandle
    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

    state_bytes = int(state_gb * 1e9)
    config = SwapConfig(folder=folder)
    threads = torch.get_num_threads()
    memory_params = make_params(state_bytes)
    in_memory = torch.optim.Adam(memory_params, lr=1e-3)
    offloaded = {}  # name -> (optimizer, its params)
    variants = {f"offloaded, {threads} thr": None}  # torch's setting; then one core left to IO, if there are two
    variants.setdefault(f"offloaded, {max(1, threads - 1)} thr", max(1, threads - 1))
    if checksum:  # the same as the first, with every swapped tensor hashed (xxh3-64) and checked
        variants[f"offloaded, {threads} thr, checksum"] = None
    for name, compute_threads in variants.items():
        params = make_params(state_bytes)
        options = config.replace(checksum=name.endswith("checksum"))
        offloaded[name] = (OffloadedOptimizer(torch.optim.Adam, params, options, lr=1e-3), params)
        offloaded[name][0].compute_threads = compute_threads
    handle = AsyncIOHandle(config.aio)
    in_memory.step()
    for optimizer, _ in offloaded.values():
        optimizer.step()  # first steps create the state
    any_offloaded = next(iter(offloaded.values()))[0]
    stored = any_offloaded.stored_bytes()
    print(
        f"state: {stored:,} bytes of Adam state ({len(memory_params)} params of {TENSOR_NUMEL:,} fp32), "
        f"chunks of {config.chunk_bytes:,} bytes, {config.buffer_count} buffers, engine {handle.engine}, "
        f"torch intra-op threads {threads}"
    )
    times: dict[str, list[float]] = {"in-memory step": [], **{name: [] for name in offloaded}, "IO only": []}
    for _ in range(rounds):
        start = time.perf_counter()
        in_memory.step()
        times["in-memory step"].append(time.perf_counter() - start)
        for name, (optimizer, _) in offloaded.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
        times["IO only"].append(io_only(handle, any_offloaded.swapper.folder, stored, config.chunk_bytes))
    same = {
        name: all(torch.equal(a, b) for a, b in zip(memory_params, params)) for name, (_, params) in offloaded.items()
    }
    for optimizer, _ in offloaded.values():
        optimizer.close()
    handle.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    for name, values in times.items():
        print(
            f"  {name:18s} median {med[name]:.3f} s, best {best[name]:.3f} s   runs: "
            f"{', '.join(f'{v:.3f}' for v in values)}"
        )
    print(f"  IO only moves {2 * stored / 1e9:.2f} GB: {2 * stored / 1e9 / med['IO only']:.2f} GB/s (1e9 bytes/s)")
    bound = max(med["in-memory step"], med["IO only"])
    best_bound = max(best["in-memory step"], best["IO only"])
    for name in offloaded:
        print(
            f"  {name}: / in-memory {med[name] / med['in-memory step']:.2f}, "
            f"/ IO only {med[name] / med['IO only']:.2f}"
            f", / max(in-memory, IO) {med[name] / bound:.2f} (target <= 1.15; best-of {best[name] / best_bound:.2f})"
            f"; parameters identical to in-memory after {rounds + 1} steps: {same[name]}"
        )


def rss_child(mode: str, state_gb: float, folder: str, numel: int) -> None:
    """In a fresh process: RSS after making params and grads, then peak RSS over 3 optimizer steps and the staging
    pool's bytes (offloaded; 0 in memory)."""
    import torch

    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

    params = make_params(int(state_gb * 1e9), numel)
    with open("/proc/self/statm") as f:
        baseline = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    if mode == "offloaded":
        optimizer = OffloadedOptimizer(torch.optim.Adam, params, SwapConfig(folder=folder), lr=1e-3)
    else:
        optimizer = torch.optim.Adam(params, lr=1e-3)
    for _ in range(3):
        optimizer.step()
    pool = optimizer.swapper.pool.held_bytes() if mode == "offloaded" else 0
    buffer = optimizer.swapper.pool.buffer_bytes if mode == "offloaded" else 0
    print(json.dumps({"baseline": baseline, "peak": peak_rss_bytes(), "pool": pool, "buffer": buffer}))


def peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM, which starts afresh at exec (ru_maxrss carries the parent's peak over a
    fork + exec, so a child of a big parent reports the parent's figure)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss(sizes: list[float], folder: str, numel: int) -> None:
    print(f"peak RSS over 3 Adam steps, above params + grads (fresh process each), parameters of {numel:,} fp32:")
    for state_gb in sizes:
        figures = {}
        for mode in ("in-memory", "offloaded"):
            out = subprocess.run(
                [sys.executable, __file__, "--rss-child", mode, str(state_gb), folder, str(numel)],
                capture_output=True,
                text=True,
                check=True,
            )
            figures[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        extra = {m: (f["peak"] - f["baseline"]) / 1e6 for m, f in figures.items()}
        state = param_count(int(state_gb * 1e9), numel) * 8 * numel / 1e6  # as make_params
        # the pool, and the heap's growth a step lets pass before it trims (a buffer: ChunkPipeline.trim)
        pool = (figures["offloaded"]["pool"] + figures["offloaded"]["buffer"]) / 1e6
        bound = extra["in-memory"] - state + 1.1 * pool
        print(
            f"  state {state_gb:.2f} GB: in-memory +{extra['in-memory']:.0f} MB, "
            f"offloaded +{extra['offloaded']:.0f} MB"
            f" (peak {figures['offloaded']['peak'] / 1e6:.0f} MB vs {figures['in-memory']['peak'] / 1e6:.0f} MB);"
            f" target: in-memory - state + 1.1 x (pool + buffer) = {extra['in-memory']:.0f} - {state:.0f}"
            f" + 1.1 x {pool:.0f}"
            f" = {bound:.0f} MB, offloaded / target {extra['offloaded'] / bound:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-gb", type=float, default=1.0, help="Adam state in GB (1e9 bytes), default 1.0")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rss-sizes", default="0.25,1.0", help="state sizes (GB) for the peak RSS runs")
    parser.add_argument("--folder", default=tempfile.gettempdir(), help="where swap files go (a real disk)")
    parser.add_argument(
        "--rss-numel",
        type=int,
        default=TENSOR_NUMEL,
        help="elements per parameter in the peak RSS runs (16777216: state over chunk_bytes)",
    )
    parser.add_argument("--rss-only", action="store_true", help="only the peak RSS runs, not the step times")
    parser.add_argument("--rss-child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--checksum", action="store_true", help="also time the offloaded step with checksum=True")
    args = parser.parse_args()
    if args.rss_child:
        mode, state_gb, folder, numel = args.rss_child
        rss_child(mode, float(state_gb), folder, int(numel))
        return
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (shared: figures are noisy)")
    sizes = [float(s) for s in args.rss_sizes.split(",") if s]
    peak_rss(sizes, args.folder, args.rss_numel)  # first, while this process is small
    if not args.rss_only:
        step_times(args.state_gb, args.rounds, args.folder, args.checksum)


if __name__ == "__main__":
    main()
