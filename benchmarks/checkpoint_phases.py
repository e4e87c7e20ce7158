"""Where deepoffload.save and deepoffload.load spend their time, with A/B switches for this round's changes.

save: per save, a timeline of where its wall time goes: the write phase (torch's zip writer into the staging sink,
copies and CRCs; its CPU time on the calling thread), the CRCs alone, waiting for staging buffers' writes, then
close (last writes, truncate of the preallocated tail, fsync), the rename and the folder's fsync; with the temporary
file preallocated (as shipped) and without (A/B, interleaved).
load: the whole-file read into one huge-page-advised buffer (as shipped), the same into ordinary pages, the
read-ahead stream path, and torch.load; interleaved, cold cache (pages evicted before each load), rotated order.
Prints per-run figures and medians; GB/s = 1e9 bytes/s.

    python benchmarks/checkpoint_phases.py [--path DIR] [--size 512M] [--rounds 4]
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from checkpoint import training_state
from common import run_main

from deepoffload.bench.measure import evict
from deepoffload.bench.sizes import format_size, parse_size
from deepoffload.checkpoint import api
from deepoffload.formats.torch_zip import streams, zip_crc
from deepoffload.formats.torch_zip import write_file as file_writer
from deepoffload.io import staged_file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument("--size", type=parse_size, default="512M", help="state-dict bytes (default 512M)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    state = training_state(args.size)
    folder = Path(tempfile.mkdtemp(prefix=".deepoffload-phases-", dir=args.path))
    phases: dict[str, list[dict[str, float]]] = {"preallocated": [], "not preallocated": []}
    current: dict[str, float] = {}
    patched: list[tuple[object, str, object]] = []

    def timed(owner: object, name: str, key: str, *, first_only: bool = False, cpu: bool = False) -> None:
        real = getattr(owner, name)

        def run(*a, **k):
            start, thread = time.perf_counter(), time.thread_time()
            try:
                return real(*a, **k)
            finally:
                if not (first_only and key in current):
                    current[key] = current.get(key, 0.0) + time.perf_counter() - start
                    if cpu:
                        current[key + " cpu"] = current.get(key + " cpu", 0.0) + time.thread_time() - thread

        patched.append((owner, name, real))
        setattr(owner, name, run)

    real_preallocate = streams._preallocate
    timed(file_writer, "write_records", "write", cpu=True)  # torch zip writer, staging copies, CRCs, buffer waits
    timed(zip_crc.CrcFiller, "_digest", "crc")
    timed(staged_file.StagedWriter, "_wait", "wait")  # for a buffer's write (in the write phase and in close)
    timed(streams.DirectWriter, "close", "close")  # last writes, truncate, fsync
    timed(os, "ftruncate", "truncate")
    timed(os, "fsync", "fsync", first_only=True)  # the file's
    timed(os, "replace", "rename")
    timed(file_writer, "fsync_folder", "folder fsync")
    totals: dict[str, list[float]] = {mode: [] for mode in phases}
    try:
        for r in range(args.rounds):
            for mode in ["preallocated", "not preallocated"] if r % 2 == 0 else ["not preallocated", "preallocated"]:
                streams._preallocate = real_preallocate if mode == "preallocated" else (lambda fd, n: False)
                current.clear()
                start = time.perf_counter()
                api.save(state, folder / "s.pt")
                totals[mode].append(time.perf_counter() - start)
                phases[mode].append(dict(current))
                evict(folder / "s.pt")
    finally:
        streams._preallocate = real_preallocate
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)
    nbytes = (folder / "s.pt").stat().st_size
    print(
        f"save: {format_size(nbytes)} file, {args.rounds} rounds; seconds per save (wait: for staging buffers' "
        f"writes, in the write phase and in close)"
    )
    keys = ["write", "write cpu", "crc", "wait", "close", "truncate", "fsync", "rename", "folder fsync"]
    for mode, rows in phases.items():
        print(f"  {mode}")
        print("    " + f"{'total':>7}" + "".join(f"{k:>13}" for k in keys))
        for total, row in zip(totals[mode], rows):
            print("    " + f"{total:7.2f}" + "".join(f"{row.get(k, 0.0):13.3f}" for k in keys))
        print(
            f"    median total {statistics.median(totals[mode]):.2f} s = "
            f"{nbytes / statistics.median(totals[mode]) / 1e9:.3f} GB/s"
        )

    path = folder / "s.pt"
    huge = mmap.MADV_HUGEPAGE if hasattr(mmap, "MADV_HUGEPAGE") else None

    def whole(advise: bool):
        def run():
            if not advise and huge is not None:
                del mmap.MADV_HUGEPAGE  # aligned_empty then leaves ordinary pages
            try:
                return api.load(path)
            finally:
                if huge is not None:
                    mmap.MADV_HUGEPAGE = huge

        return run

    def stream():
        with streams.DirectReader(path) as reader:
            return torch.load(reader)

    loaders = {
        "whole file, huge pages (shipped)": whole(True),
        "whole file, ordinary pages": whole(False),
        "read-ahead stream": stream,
        "torch.load": lambda: torch.load(path),
    }
    seconds: dict[str, list[float]] = {name: [] for name in loaders}
    try:
        for r in range(args.rounds):
            names = list(loaders)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                evict(path)
                gc.collect()
                start = time.perf_counter()
                loaded = loaders[name]()
                seconds[name].append(time.perf_counter() - start)
                del loaded
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"load: {args.rounds} rounds interleaved, cold cache; GB/s per round, median")
    for name, values in seconds.items():
        print(
            f"  {name:<34}"
            + " ".join(f"{nbytes / s / 1e9:5.2f}" for s in values)
            + f"   median {nbytes / statistics.median(values) / 1e9:.2f}"
        )
    return 0


if __name__ == "__main__":
    run_main("checkpoint_phases", main)
