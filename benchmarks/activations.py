"""Saved activations on storage: a training step (forward and backward) of a deep MLP whose saved activations are
several times the memory ``offload_activations`` holds for them, four ways, each in a fresh process, interleaved
A B C D per round:

- ``plain``: saved activations in memory;
- ``offload``: inside ``deepoffload.offload_activations(folder)`` (defaults: at most 32 MiB being written, prefetch 2);
- ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) on every layer: the usual way to the same memory;
- ``disk``: the raw disk doing the same bytes: the bytes ``offload`` wrote, written in 8 MiB requests through the
  async-IO handle and read back, with no compute (what the step's IO costs when nothing overlaps it).

Per variant: the median step time (after one warm-up step) and the peak of the step's memory over what the process
held before it (``ru_maxrss`` of the child after the steps less its RSS before them: the saved activations and the
step's temporaries); for ``offload`` also the library's own part, ``stats()["peak_held_bytes"]`` (tensors being
written plus reads ahead not yet used, at once), over the saved bytes: the rest of its peak is the model's (its
gradients and the forward's and backward's live tensors). Ratios: offload over plain, over checkpoint and over
max(plain, disk) (1 where the IO overlaps the compute perfectly); peak of offload over plain (target <= 0.20 of
keeping them in memory). The load average at the start and end is printed with the figures (a shared machine disturbs
them).

    python benchmarks/activations.py [--folder DIR] [--width 1024] [--layers 16] [--rows 8192] [--steps 3]
        [--rounds 3] [--json PATH] [--quick]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402

VARIANTS = ("plain", "offload", "checkpoint", "disk")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def training_step(variant: str, args, stats: dict):
    """The step of ``variant`` (plain, offload, checkpoint) on a deep MLP; offload's bytes written go to ``stats``."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from deepoffload import offload_activations

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU()) for _ in range(args.layers))
    )
    x = torch.randn(args.rows, args.width, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        if variant == "offload":
            with offload_activations(args.folder) as off:
                model(x).square().mean().backward()
            stats["written"] = off.stats()["bytes_written"]
            stats["held"] = max(stats.get("held", 0), off.stats()["peak_held_bytes"])
        elif variant == "checkpoint":
            h = x
            for layer in model:
                h = checkpoint(layer, h, use_reentrant=False)
            h.square().mean().backward()
        else:
            model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def disk_step(args):
    """The raw disk doing ``args.disk_bytes``: written in 8 MiB requests, 4 in flight, then read back."""
    from deepoffload import AsyncIOHandle
    from deepoffload.io.buffers import aligned_empty

    nbytes, chunk = args.disk_bytes, 8 << 20
    buffers = [aligned_empty(chunk) for _ in range(4)]
    for b in buffers:
        b.fill_(1)
    path = os.path.join(args.folder, "disk.bin")

    def step() -> None:
        with AsyncIOHandle() as handle:
            for write in (True, False):
                pending = []
                for i, offset in enumerate(range(0, nbytes, chunk)):
                    if len(pending) == len(buffers):
                        pending.pop(0).wait()
                    b = buffers[i % len(buffers)]
                    if write:
                        pending.append(handle.write_async(b, path, offset, truncate=False))
                    else:
                        pending.append(handle.read_async(b, path, offset))
                for request in pending:
                    request.wait()
        os.unlink(path)

    return step


def child(variant: str, args) -> dict:
    """One variant's steps in this process; returns its median step time, peak over the start and bytes written."""
    stats = {"written": 0, "held": 0}
    step = disk_step(args) if variant == "disk" else training_step(variant, args, stats)
    start = rss_bytes()
    step()  # warm-up
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "seconds": statistics.median(times),
        "peak": peak - start,
        "written": stats["written"],
        "held": stats["held"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 layers of 64 on 256 rows, 1 round")
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--disk-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.rows, args.rounds, args.steps = 64, 2, 256, 1, 1
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        return compare(args, folder)


def compare(args, folder: str) -> int:
    saved = 2 * args.layers * args.rows * args.width * 4
    load = [os.getloadavg()[0]]
    print(f"saved activations per step: {saved / 2**20:.0f} MiB; load average {load[0]:.2f}", flush=True)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    disk_bytes = saved
    for _ in range(args.rounds):
        for variant in VARIANTS:
            argv = [sys.executable, os.path.abspath(__file__), "--child", variant, "--folder", folder]
            argv += ["--width", str(args.width), "--layers", str(args.layers), "--rows", str(args.rows)]
            argv += ["--steps", str(args.steps), "--disk-bytes", str(disk_bytes)]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
            if proc.returncode:
                print(f"{variant} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            result = json.loads(proc.stdout.splitlines()[-1])
            runs[variant].append(result)
            if variant == "offload" and result["written"]:
                disk_bytes = result["written"]  # the disk variant does the bytes offload wrote
    load.append(os.getloadavg()[0])
    print(f"{'variant':<12}{'step s':>10}{'peak MiB':>10}   per round (s)")
    for v in VARIANTS:
        seconds = [r["seconds"] for r in runs[v]]
        peak = statistics.median(r["peak"] for r in runs[v]) / 2**20
        print(f"{v:<12}{statistics.median(seconds):10.3f}{peak:10.0f}   " + " ".join(f"{s:.3f}" for s in seconds))

    def per_round(a: str, b: str | None = None, key: str = "seconds") -> list[float]:
        out = []
        for i in range(args.rounds):
            den = max(runs["plain"][i][key], runs["disk"][i][key]) if b is None else runs[b][i][key]
            out.append(runs[a][i][key] / den)
        return out

    rows = [
        ("offload step / plain step", per_round("offload", "plain"), 1.10, False),
        ("offload step / checkpoint step", per_round("offload", "checkpoint"), 1.0, False),
        ("offload step / max(plain step, raw disk same bytes)", per_round("offload"), 1.10, False),
        ("raw disk same bytes / plain step", per_round("disk", "plain"), None, False),
        ("offload peak / plain peak", per_round("offload", "plain", "peak"), 0.20, False),
        ("checkpoint peak / plain peak", per_round("checkpoint", "plain", "peak"), None, False),
        (
            "offload's own part (writes + reads ahead) / saved",
            [r["held"] / saved for r in runs["offload"]],
            None,
            False,
        ),
    ]
    for label, ratios, bound, _ in rows:
        target = "" if bound is None else f" (target <= {bound})"
        print(f"{label}: {statistics.median(ratios):.3f}{target}   " + " ".join(f"{r:.2f}" for r in ratios))
    print(f"load average: {load[0]:.2f} at the start, {load[1]:.2f} at the end", flush=True)
    if args.json:
        results = []
        for label, ratios, bound, higher in rows:
            result = {"label": label, "value": statistics.median(ratios), "per_round": ratios}
            result["higher_is_better"] = higher
            if bound is not None:
                result["bound"] = bound
            results.append(result)
        write_json(
            args.json,
            "activations",
            f"Saved activations on storage: MLP {args.layers}x{args.width}, {args.rows} rows "
            f"({saved / 2**20:.0f} MiB saved), load {load[0]:.1f}-{load[1]:.1f}",
            results,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
