"""Checkpoint load speed: deepoffload.formats.load_file (O_DIRECT through the async-IO op) against
safetensors.torch.load_file and torch.load(mmap=True, weights_only=True), and against the raw read speed that
`deepoffload bench` measures (one read of a file of the same size into a page-aligned, page-locked buffer, same
folder, default settings), and that same read into a newly allocated buffer ("raw read, fresh", the fair bound
benchmarks/checkpoint.py uses for its loader): a loader has to put the tensors in fresh memory, whose page faults
cost time of their own ("fresh memory": allocating the same bytes and touching every page, no IO). "raw read,
faulted ahead" reads the file in pieces of the largest tensor's size (the loader's largest span here) into new
buffers, each faulted in before its read is submitted while the previous piece is read (two in flight): the
loader's own pattern without headers or tensors, the most a loader filling new memory that way can reach.

With ``--part into`` (or ``both``, the default) the same loaders also load into tensors that already exist, as
``model.load_state_dict`` does for a model built in memory: ``CheckpointReader.read_into`` (spans read into buffers
it reuses, then copied) against ``load_file`` / ``torch.load(mmap=True)`` followed by ``copy_`` into each
destination. No new memory is returned there, so the locked raw read is the bound.

The checkpoint is a Hugging Face sharded safetensors folder written by deepoffload.formats.save_sharded, plus the
same tensors in one torch.save file. Every load is cold: each file is fsynced and its cached pages dropped
(posix_fadvise DONTNEED) before the timed load, and every load ends by touching every page of every tensor (a
mapped loader reads from storage only then). The loaders run interleaved round by round, rotating which goes first.
Printed: GB/s (1e9 bytes/s) per loader (median over rounds), and the median of per-round ratios.

    python benchmarks/checkpoint_load.py [--path DIR] [--size 1G] [--shard-size 256M] [--rounds 5]
                                         [--part new|into|both] [--memory recycled|reported]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
from common import MEMORY_STATES, ratio_row, run_main, settle_memory

from deepoffload.bench.measure import BenchError, evict, scratch_file, time_transfer
from deepoffload.bench.sizes import format_size, parse_size
from deepoffload.diagnostics import direct_io_works
from deepoffload.formats import CheckpointReader, load_file, save_sharded
from deepoffload.io.buffers import aligned_empty
from deepoffload.io.handle import AsyncIOHandle

# A transformer block's worth of sizes in bytes (fp16 7B-like rows, scaled down): big and small tensors mixed.
TENSOR_BYTES = (32 << 20, 32 << 20, 8 << 20, 8 << 20, 88 << 20, 88 << 20, 88 << 20, 8 << 10, 8 << 10)


def make_checkpoint(folder: Path, total: int, shard_bytes: int) -> tuple[list[Path], Path, int]:
    """Write ``total`` bytes of bf16 tensors as sharded safetensors and as one torch.save file; return the shard
    paths, the torch file and the bytes of tensor data."""
    pattern = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    tensors, written, i = {}, 0, 0
    while written < total:
        nbytes = min(TENSOR_BYTES[i % len(TENSOR_BYTES)], total - written)
        nbytes -= nbytes % 2
        start = (i * 4099) % (pattern.numel() - nbytes) if nbytes < pattern.numel() else 0
        data = (
            pattern[start : start + nbytes]
            if nbytes <= pattern.numel()
            else pattern.repeat(-(-nbytes // pattern.numel()))[:nbytes]
        )
        tensors[f"model.layers.{i // len(TENSOR_BYTES)}.w{i % len(TENSOR_BYTES)}"] = data.clone().view(torch.bfloat16)
        written += nbytes
        i += 1
    shards = save_sharded(tensors, folder / "safetensors", max_shard_bytes=shard_bytes)
    torch_file = folder / "model.pt"
    torch.save(tensors, torch_file)
    return shards, torch_file, written


def read_faulted_ahead(handle: AsyncIOHandle, path: Path, nbytes: int, span: int) -> list[torch.Tensor]:
    """Read ``path`` in ``span``-byte pieces into new buffers, each faulted in before its read is submitted, two
    reads in flight."""
    buffers, reads, offset = [], [], 0
    while offset < nbytes or reads:
        while offset < nbytes and len(reads) < 2:
            buffers.append(aligned_empty(min(span, nbytes - offset), pin=False, prefault=True))
            reads.append(handle.read_async(buffers[-1], path, offset))
            offset += buffers[-1].numel()
        reads.pop(0).wait()
    return buffers


def touch(tensors) -> int:
    """Read one byte of every page of every tensor."""
    total = 0
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        total += int(flat[::4096].sum())
    return total


def timed(files: list[Path], load, memory: str, nbytes: int) -> float:
    """Seconds to ``load()`` from a cold cache and touch every page of what it returns."""
    for path in files:
        evict(path)
    gc.collect()
    settle_memory(memory, nbytes)
    start = time.perf_counter()
    loaded = load()
    touch(loaded)
    seconds = time.perf_counter() - start
    del loaded
    gc.collect()
    return seconds


def copy_into(destinations: dict[str, torch.Tensor], state) -> tuple:
    """What ``model.load_state_dict(state)`` does with the values: copy each into its existing tensor."""
    with torch.no_grad():
        for name, tensor in state.items():
            destinations[name].copy_(tensor)
    return ()


def print_table(
    title: str, gbps: dict[str, list[float]], ours: str, others: Sequence[str], bounds: Sequence[tuple[str, str]]
) -> None:
    print(title)
    print(f"{'loader':<25}{'GB/s (median)':>14}   per round")
    for name, values in gbps.items():
        print(f"{name:<25}{statistics.median(values):>14.3f}   " + " ".join(f"{v:.2f}" for v in values))
    print()
    print(f"{'ratio':<37}{'ours':>8}{'other':>8}{'ratio':>8}   per round")
    for other in others:
        print(ratio_row(f"{ours} / {other:<{35 - len(ours)}}", gbps[ours], gbps[other], (8, 8, 8)))
    print()
    print("bounds: the most a loader reading at a raw read's speed could gain over each loader here")
    for raw, other in bounds:
        print(ratio_row(f"{raw} / {other:<{34 - len(raw)}}", gbps[raw], gbps[other], (8, 8, 8)))
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--path",
        default=None,
        help="folder on the storage to measure (default: a temporary folder in the current directory)",
    )
    parser.add_argument("--size", type=parse_size, default=parse_size("1G"), help="checkpoint bytes (default 1G)")
    parser.add_argument("--shard-size", type=parse_size, default=parse_size("256M"), help="max bytes per shard")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--part",
        choices=("new", "into", "both"),
        default="both",
        help="load into new memory (what each loader returns), into existing tensors, or both",
    )
    parser.add_argument(
        "--memory",
        choices=MEMORY_STATES,
        default="recycled",
        help="free memory's state before each load (see benchmarks/common.py settle_memory)",
    )
    args = parser.parse_args()
    from safetensors.torch import load_file as st_load_file

    base = Path(args.path) if args.path else Path.cwd()
    if not base.is_dir():
        raise BenchError(f"{base} is not an existing folder; pass --path a folder on the storage to measure")
    if shutil.disk_usage(base).free < 3 * args.size + (64 << 20):
        raise BenchError(f"{base} needs about {format_size(3 * args.size)} free; pass a smaller --size")
    work = Path(tempfile.mkdtemp(prefix=".deepoffload-ckpt-bench-", dir=base))
    try:
        shards, torch_file, nbytes = make_checkpoint(work, args.size, args.shard_size)
        folder = work / "safetensors"
        with scratch_file(work, nbytes) as raw_path, AsyncIOHandle() as handle:
            buffer = aligned_empty(nbytes)
            buffer.fill_(7)
            handle.write(buffer, raw_path)
            direct = direct_io_works(raw_path)
            destinations: dict[str, torch.Tensor] = {}
            if args.part != "new":  # a model's parameters: ordinary torch memory, touched once, kept all along
                with CheckpointReader(folder) as reader:
                    for name in reader.names():
                        shape, dtype = reader.shape_dtype(name)
                        destinations[name] = torch.zeros(shape, dtype=dtype)

            def raw_read_fresh():
                evict(raw_path)
                settle_memory(args.memory, nbytes)
                start = time.perf_counter()
                handle.read(aligned_empty(nbytes, pin=False), raw_path)
                return time.perf_counter() - start

            def raw_read_faulted_ahead():
                evict(raw_path)
                settle_memory(args.memory, nbytes)
                start = time.perf_counter()
                read_faulted_ahead(handle, raw_path, nbytes, max(TENSOR_BYTES))
                return time.perf_counter() - start

            def fresh_memory():  # no IO: allocate the bytes and touch every page
                settle_memory(args.memory, nbytes)
                start = time.perf_counter()
                aligned_empty(nbytes, pin=False)[::4096].fill_(1)
                return time.perf_counter() - start

            def into(load):
                return lambda: copy_into(destinations, load())

            def read_into():
                with CheckpointReader(folder, handle=handle) as reader:
                    reader.read_into(destinations)
                return ()

            safetensors_state = lambda: {n: t for s in shards for n, t in st_load_file(s).items()}  # noqa: E731
            torch_state = lambda: torch.load(torch_file, mmap=True, weights_only=True)  # noqa: E731
            runs = {"raw read": lambda: time_transfer(handle, "read", buffer, raw_path, direct).seconds}
            if args.part != "into":
                runs.update(
                    {
                        "deepoffload": lambda: timed(shards, lambda: load_file(folder).values(), args.memory, nbytes),
                        "safetensors": lambda: timed(shards, lambda: safetensors_state().values(), args.memory, nbytes),
                        "torch.load": lambda: timed([torch_file], lambda: torch_state().values(), args.memory, nbytes),
                        "raw read, fresh": raw_read_fresh,
                        "raw read, faulted ahead": raw_read_faulted_ahead,
                        "fresh memory": fresh_memory,
                    }
                )
            if args.part != "new":
                runs.update(
                    {
                        "deepoffload, into": lambda: timed(shards, read_into, args.memory, nbytes),
                        "safetensors, into": lambda: timed(shards, into(safetensors_state), args.memory, nbytes),
                        "torch.load, into": lambda: timed([torch_file], into(torch_state), args.memory, nbytes),
                    }
                )
            order = list(runs)
            times: dict[str, list[float]] = {name: [] for name in order}
            for r in range(args.rounds):
                for name in order[r % len(order) :] + order[: r % len(order)]:
                    times[name].append(runs[name]())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gbps = {name: [nbytes / s / 1e9 for s in values] for name, values in times.items()}
    print(
        f"checkpoint: {format_size(nbytes)} of bf16 tensors, {len(shards)} safetensors shards and one torch.save "
        f"file; cold cache; {args.rounds} interleaved rounds; O_DIRECT: {direct}; free memory {args.memory} before "
        f"each load"
    )
    print()
    raw = {"raw read": gbps["raw read"]}
    if args.part != "into":
        new = ("deepoffload", "safetensors", "torch.load", "raw read, fresh", "raw read, faulted ahead", "fresh memory")
        print_table(
            "into new memory (each loader's own tensors, every page touched after the load):",
            {**{n: gbps[n] for n in new}, **raw},
            "deepoffload",
            ("safetensors", "torch.load", "raw read", "raw read, fresh", "raw read, faulted ahead"),
            [(bound, other) for bound in ("raw read", "raw read, fresh") for other in ("safetensors", "torch.load")],
        )
    if args.part != "new":
        into_names = ("deepoffload, into", "safetensors, into", "torch.load, into")
        print_table(
            "into existing tensors (a model's parameters, as load_state_dict fills them):",
            {**{n: gbps[n] for n in into_names}, **raw},
            "deepoffload, into",
            ("safetensors, into", "torch.load, into", "raw read"),
            [("raw read", other) for other in ("safetensors, into", "torch.load, into")],
        )
    return 0


if __name__ == "__main__":
    run_main("checkpoint_load", main)
