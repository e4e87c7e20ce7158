"""Where deepoffload.save's time goes against its bounds: its write path and its checksums, each A/B in one run.

Two groups, each method once per round in a rotated order (interleaved), each against its bound measured in the
same round (ratios: bound time / method time, medians of per-round ratios; 1.0 is the bound's speed):

- the write part, no rename: a raw write of the same number of bytes from one page-aligned buffer to a new file with
  fsync (the bound; each method's previous file is removed before it, untimed); the tensors copied through
  ``DirectWriter``'s staging buffers (what ``save`` does); the tensors' page-aligned middles written straight from their
  own memory, eight requests in flight (no copy);
- the whole save of a model + AdamW state dict over an existing checkpoint: the durable raw write of the same bytes
  (new file, fsync, rename over the previous one, folder fsync) that frees the replaced file on a thread as ``save``
  does (the bound); ``deepoffload.save``; ``deepoffload.save(checksum=False)``;
- the goal of issue 41 (``--goal-only`` runs only this), on each ``--path`` (one per drive) in turn:
  ``deepoffload.save`` of ``--tensors`` tensors of ``--tensor-size`` (default 64 x 16 MiB) into a new file against
  the plainest bound, the op's O_DIRECT write of the same bytes from one aligned buffer into a new file, fsync, rename
  and folder fsync (no file replaced by either: each one's previous file is removed untimed before it). One untimed
  warm-up round first (the first save of a process allocates its staging buffers). Target: 0.9.

``deepoffload.save`` takes one path; several drives are measured one after the other, each against its own bound.

    python benchmarks/save_parts.py [--path DIR ...] [--size 1G] [--rounds 9] [--goal-only] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from checkpoint import fsync_path, tensors_of, training_state
from common import run_main, write_json

import deepoffload
from deepoffload.bench.sizes import format_size, parse_size
from deepoffload.formats.torch_zip.streams import DirectWriter
from deepoffload.io import retire

PAGE = 4096
IN_FLIGHT = 8


def interleaved(
    methods: dict[str, Callable[[], None]], rounds: int, before: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Seconds of each method per round, the order rotated round by round; ``before`` (untimed) and a write-back of
    the page cache before each."""
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if before is not None:
                before()
            os.sync()
            start = time.perf_counter()
            methods[name]()
            seconds[name].append(time.perf_counter() - start)
            retire.wait()  # a file freed behind one method is freed before the next is timed
    return seconds


def report(title: str, seconds: dict[str, list[float]], bound: str) -> None:
    print(title)
    print(f"  {'method':<44}{'median s':>10}{'bound/this':>12}   per-round")
    for name, times in seconds.items():
        ratios = [b / t for b, t in zip(seconds[bound], times)]
        print(
            f"  {name:<44}{statistics.median(times):10.3f}{statistics.median(ratios):12.2f}   "
            + " ".join(f"{x:.2f}" for x in ratios)
        )


NEW_FILE_BOUND = "raw write, new file + fsync + rename + folder fsync (bound)"


def goal_group(path: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per round of ``deepoffload.save`` of the goal's state dict and of its new-file bound, on ``path``."""
    folder = Path(tempfile.mkdtemp(prefix="save-goal-", dir=path))
    names = ("raw.tmp", "raw.bin", "save.pt")
    try:
        torch.manual_seed(0)
        numel = args.tensor_size // 4
        state = {f"layer{i}.weight": torch.randn(numel) for i in range(args.tensors)}
        raw = deepoffload.aligned_empty(numel * 4 * args.tensors)
        raw.fill_(1)
        with deepoffload.AsyncIOHandle() as handle:

            def bound() -> None:
                temporary, target = folder / "raw.tmp", folder / "raw.bin"
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    handle.write(raw, temporary, truncate=False)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(temporary, target)
                fsync_path(folder)

            def remove_previous() -> None:
                for name in names:
                    (folder / name).unlink(missing_ok=True)

            methods = {NEW_FILE_BOUND: bound, "deepoffload.save": lambda: deepoffload.save(state, folder / "save.pt")}
            interleaved(methods, 1, before=remove_previous)  # warm-up: staging buffers, page tables, the op's threads
            return interleaved(methods, args.rounds, before=remove_previous)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", action="append", help="folder on the disk to measure (repeat: one per drive)")
    parser.add_argument("--size", type=parse_size, default="1G", help="state-dict bytes (default 1G)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tensors", type=int, default=64, help="tensors of the goal's state dict (default 64)")
    parser.add_argument("--tensor-size", type=parse_size, default="16M", help="bytes per tensor (default 16M)")
    parser.add_argument("--goal-only", action="store_true", help="only the goal group (save vs new-file raw write)")
    parser.add_argument("--json", metavar="FILE", help="write the goal's ratios for benchmarks/plot.py")
    args = parser.parse_args()
    paths = args.path or [tempfile.gettempdir()]
    goal = {path: goal_group(path, args) for path in paths}
    print(
        f"save_parts goal: deepoffload.save of {args.tensors} x {format_size(args.tensor_size)} into a new file vs "
        f"the new-file durable raw write, {args.rounds} rounds interleaved (bound/this: 1.0 is the bound's speed)"
    )
    for path, seconds in goal.items():
        report(f"on {path}:", seconds, NEW_FILE_BOUND)
    if args.json:
        results = []
        for index, seconds in enumerate(goal.values()):
            ratios = [b / t for b, t in zip(seconds[NEW_FILE_BOUND], seconds["deepoffload.save"])]
            label = "deepoffload.save / new-file raw write" + (f", drive {index + 1}" if len(goal) > 1 else "")
            results.append(
                {
                    "label": label,
                    "value": round(statistics.median(ratios), 3),
                    "bound": 0.9,
                    "per_round": [round(r, 3) for r in ratios],
                }
            )
        title = (
            f"deepoffload.save of {args.tensors} x {format_size(args.tensor_size)}: speed / the new-file raw write's"
        )
        write_json(args.json, "save_parts", title, results)
    if args.goal_only:
        return 0
    folder = Path(tempfile.mkdtemp(prefix="save-parts-", dir=paths[0]))
    try:
        state = training_state(args.size)
        tensors = [t for _, t in tensors_of(state)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        raw = deepoffload.aligned_empty(nbytes)
        raw.fill_(1)
        with deepoffload.AsyncIOHandle() as handle:

            def new_file(name: str) -> Path:  # removed by remove_written() before each timed write
                return folder / name

            def remove_written() -> None:
                for name in ("raw", "staged", "direct"):
                    (folder / name).unlink(missing_ok=True)

            def write_synced(path: Path) -> None:  # the raw buffer to a new file, fsynced
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    handle.write(raw, path, truncate=False)
                    os.fsync(fd)
                finally:
                    os.close(fd)

            def raw_write() -> None:
                write_synced(new_file("raw"))

            def staged_copy() -> None:
                writer = DirectWriter(new_file("staged"), size_hint=nbytes)
                try:
                    for t in tensors:
                        writer.write(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))
                finally:
                    writer.close()

            def own_memory() -> None:
                path = new_file("direct")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                    requests, offset = [], 0
                    for t in tensors:
                        data = t.detach().reshape(-1).view(torch.uint8)
                        skip = (-data.data_ptr()) % PAGE
                        length = max(0, data.numel() - skip) // PAGE * PAGE
                        if length == 0:
                            continue
                        if len(requests) == IN_FLIGHT:
                            requests.pop(0).wait()
                        requests.append(handle.write_async(data[skip : skip + length], path, offset, truncate=False))
                        offset += length
                    for request in requests:
                        request.wait()
                    os.fsync(fd)
                finally:
                    os.close(fd)

            write_part = interleaved(
                {
                    "raw write, new file + fsync (bound)": raw_write,
                    "tensors through the staging copy": staged_copy,
                    "tensors' own memory, no copy": own_memory,
                },
                args.rounds,
                before=remove_written,  # freeing the previous file's blocks is not part of a write
            )

            def durable_behind() -> None:
                temporary, target = folder / "raw.tmp", folder / "raw.bin"
                write_synced(temporary)
                retire.replace(str(temporary), str(target))
                fsync_path(folder)

            whole = interleaved(
                {
                    "durable raw write, old file freed behind (bound)": durable_behind,
                    "deepoffload.save": lambda: deepoffload.save(state, folder / "save.pt"),
                    "deepoffload.save(checksum=False)": lambda: deepoffload.save(
                        state, folder / "nocrc.pt", checksum=False
                    ),
                },
                args.rounds,
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"save_parts: {format_size(nbytes)} in {len(tensors)} tensors (model + AdamW), {args.rounds} rounds "
        f"interleaved; bound/this = the bound's time / the method's (1.0: the bound's speed)"
    )
    report("write part (no rename):", write_part, "raw write, new file + fsync (bound)")
    report("whole save over an existing checkpoint:", whole, "durable raw write, old file freed behind (bound)")
    return 0


if __name__ == "__main__":
    run_main("save_parts", main)
