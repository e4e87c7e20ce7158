"""Where deepoffload.save's time goes against its bounds: its write path and its checksums, each A/B in one run.

Two groups, each method once per round in a rotated order (interleaved), each against its bound measured in the
same round (ratios: bound time / method time, medians of per-round ratios; 1.0 is the bound's speed):

- the write part, no rename: a raw write of the same number of bytes from one page-aligned buffer to a new file with
  fsync (the bound; each method's previous file is removed before it, untimed); the tensors copied through
  ``DirectWriter``'s staging buffers (what ``save`` does); the tensors' page-aligned middles written straight from their
  own memory, eight requests in flight (no copy);
- the whole save of a model + AdamW state dict over an existing checkpoint: the durable raw write of the same bytes
  (new file, fsync, rename over the previous one, folder fsync) that frees the replaced file on a thread as ``save``
  does (the bound); ``deepoffload.save``; ``deepoffload.save(checksum=False)``.

    python benchmarks/save_parts.py [--path DIR] [--size 1G] [--rounds 9]
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
from common import run_main

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument("--size", type=parse_size, default="1G", help="state-dict bytes (default 1G)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="save-parts-", dir=args.path))
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
