"""Where deepoffload.save and deepoffload.load spend their time, with A/B switches for this round's changes.

save: per save, the wall time of the write phase (torch's zip writer into the staging sink) against the CPU time
of the calling thread in it (the rest is waiting for a CPU or for writes), and the file's fsync, with the temporary
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
from deepoffload.checkpoint import api, streams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument("--size", type=parse_size, default="512M", help="state-dict bytes (default 512M)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    state = training_state(args.size)
    folder = Path(tempfile.mkdtemp(prefix=".deepoffload-phases-", dir=args.path))
    phases: dict[str, list[tuple[float, float, float]]] = {"preallocated": [], "not preallocated": []}
    real_write_records, real_fsync, real_preallocate = api.write_records, os.fsync, streams._preallocate
    current: dict[str, float] = {}

    def write_records(*a):
        start, cpu = time.perf_counter(), time.thread_time()
        real_write_records(*a)
        current["write"], current["cpu"] = time.perf_counter() - start, time.thread_time() - cpu

    def fsync(fd):
        start = time.perf_counter()
        real_fsync(fd)
        current.setdefault("fsync", time.perf_counter() - start)  # the file's, not the folder's

    try:
        api.write_records, os.fsync = write_records, fsync
        for r in range(args.rounds):
            for mode in (["preallocated", "not preallocated"] if r % 2 == 0 else
                         ["not preallocated", "preallocated"]):
                streams._preallocate = real_preallocate if mode == "preallocated" else (lambda fd, n: False)
                current.clear()
                api.save(state, folder / "s.pt")
                phases[mode].append((current["write"], current["cpu"], current["fsync"]))
                evict(folder / "s.pt")
    finally:
        api.write_records, os.fsync, streams._preallocate = real_write_records, real_fsync, real_preallocate
    nbytes = (folder / "s.pt").stat().st_size
    print(f"save: {format_size(nbytes)} file, {args.rounds} rounds; per save: write phase s / calling thread CPU s "
          f"/ file fsync s")
    for mode, rows in phases.items():
        print(f"  {mode:<18}" + "   ".join(f"{w:.2f}/{c:.2f}/{f:.3f}" for w, c, f in rows)
              + f"   median fsync {statistics.median(f for _, _, f in rows):.3f} s")

    path = folder / "s.pt"
    huge = mmap.MADV_HUGEPAGE if hasattr(mmap, "MADV_HUGEPAGE") else None

    def whole(advise: bool):
        def run():
            if not advise and huge is not None:
                del mmap.MADV_HUGEPAGE  # huge_page_empty then leaves ordinary pages
            try:
                return api.load(path)
            finally:
                if huge is not None:
                    mmap.MADV_HUGEPAGE = huge
        return run

    def stream():
        with streams.DirectReader(path) as reader:
            return torch.load(reader)

    loaders = {"whole file, huge pages (shipped)": whole(True), "whole file, ordinary pages": whole(False),
               "read-ahead stream": stream, "torch.load": lambda: torch.load(path)}
    seconds: dict[str, list[float]] = {name: [] for name in loaders}
    try:
        for r in range(args.rounds):
            names = list(loaders)
            for name in names[r % len(names):] + names[:r % len(names)]:
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
        print(f"  {name:<34}" + " ".join(f"{nbytes / s / 1e9:5.2f}" for s in values)
              + f"   median {nbytes / statistics.median(values) / 1e9:.2f}")
    return 0


if __name__ == "__main__":
    run_main("checkpoint_phases", main)
