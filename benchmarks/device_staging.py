"""Streaming a file into accelerator memory: ``DeviceStager`` (two page-locked host buffers, file read of chunk k+1
overlapping the device copy of chunk k) against the disk's own read speed (the same handle reading into one
page-locked host buffer), against ``torch.load(map_location=device)`` of the same bytes, and against a plain copy
from page-locked host memory to the device (no disk). Each round runs every variant, in a rotating order; the file's
cached pages are evicted before each read. Needs an accelerator that torch sees (CUDA, ROCm, XPU, ...).

    python benchmarks/device_staging.py [--path DIR] [--size 1G] [--chunk 8M] [--rounds 3] [--engine auto]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import ratio_row, run_main

from deepoffload.bench.measure import BenchError, evict, make_buffer, scratch_file
from deepoffload.bench.sizes import format_size, parse_size
from deepoffload.diagnostics import direct_io_works
from deepoffload.io.handle import AsyncIOHandle
from deepoffload.io.staging import DEFAULT_CHUNK_BYTES, DeviceStager

VARIANTS = ("staged", "disk", "torch.load", "h2d copy", "staged write", "disk write")


def timed(run) -> float:
    """Seconds ``run()`` takes, the accelerator's queued work included."""
    torch.accelerator.synchronize()
    start = time.perf_counter()
    run()
    torch.accelerator.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument("--size", type=parse_size, default="1G", help="bytes per transfer (default 1G)")
    parser.add_argument("--chunk", type=parse_size, default=str(DEFAULT_CHUNK_BYTES), help="bytes per host buffer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", default="auto")
    args = parser.parse_args()
    device = torch.accelerator.current_accelerator(check_available=True)
    if device is None:
        raise BenchError("torch sees no accelerator here; run this on a machine with a GPU (and a torch built for it)")
    host = make_buffer(args.size, "pinned")
    on_device = host.to(device)
    target = torch.empty_like(on_device)
    gbps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with (
        scratch_file(args.path, args.size) as raw,
        scratch_file(args.path, args.size, spare=1 << 20) as saved,
        AsyncIOHandle(engine=args.engine) as handle,
    ):
        stager = DeviceStager(handle, chunk_bytes=args.chunk)
        handle.write(host, raw)
        torch.save(host.clone(), saved)  # a plain tensor (not a view of the pinned mapping)
        direct = direct_io_works(raw)

        def read_staged() -> None:
            stager.read(target, raw)

        def read_disk() -> None:
            handle.read(host, raw)

        def load() -> None:
            target.copy_(torch.load(saved, map_location=device, weights_only=True))

        def write_staged() -> None:
            stager.write(on_device, raw, truncate=False, fsync=not direct)

        def write_disk() -> None:
            handle.write(host, raw, truncate=False, fsync=not direct)

        runs = {
            "staged": (read_staged, raw),
            "disk": (read_disk, raw),
            "torch.load": (load, saved),
            "h2d copy": (lambda: target.copy_(host), None),
            "staged write": (write_staged, None),
            "disk write": (write_disk, None),
        }
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for variant in order:
                run, evicted = runs[variant]
                if evicted is not None:
                    evict(evicted)
                target.zero_()
                gbps[variant].append(args.size / timed(run) / 1e9)
                if variant in ("staged", "torch.load", "h2d copy") and not torch.equal(target, on_device):
                    raise BenchError(f"{variant}: the bytes on the device differ from the file's")
        print(
            f"device staging: {format_size(args.size)} to/from {device.type}, engine {handle.engine}, "
            f"{format_size(stager.chunk_bytes)} host buffers x2, {'O_DIRECT' if direct else 'buffered'}, "
            f"{args.rounds} rounds interleaved; GB/s = 1e9 bytes/s; folder {Path(args.path).resolve()}"
        )
    print("median GB/s: " + ", ".join(f"{v} {statistics.median(x):.3f}" for v, x in gbps.items()))
    print(f"{'':<24}{'A GB/s':>10}{'B GB/s':>10}{'A/B':>8}   per-round ratios")
    for label, a, b in (
        ("staged / disk read", "staged", "disk"),
        ("staged / torch.load", "staged", "torch.load"),
        ("staged / h2d copy", "staged", "h2d copy"),
        ("staged / disk write", "staged write", "disk write"),
    ):
        print(ratio_row(f"{label:<24}", gbps[a], gbps[b], (10, 10, 8)))
    return 0


if __name__ == "__main__":
    run_main("device_staging", main)
