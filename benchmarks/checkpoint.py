"""Checkpoint save and load of a model + AdamW state dict: deepoffload.save/load and deepoffload.dcp against
torch.save + fsync, torch.load (and mmap=True), safetensors and DCP's own FileSystemWriter/Reader, with raw
sequential IO through the op (what `deepoffload bench` measures) as the ceiling.

Every method runs once per round, in an order rotated round by round (interleaved); every file's pages are evicted
from the page cache before it is read (cold cache) and every save includes its fsync. Prints the median GB/s of
each method (state-dict bytes / seconds; GB = 1e9 bytes) and the median of per-round ratios against deepoffload.
Also times `save_async`: how long the call blocks, against its snapshot copy alone and against cloning every tensor.

    python benchmarks/checkpoint.py [--path DIR] [--size 1G] [--rounds 3] [--core] [--memory recycled|reported]
                                     [--json PATH]

DeepSpeed's FastFileWriter (torch.save into it, its own close() fsyncs) runs through DeepSpeed's own async_io op
when that op has been built (its JIT build takes minutes, so this benchmark never starts it); otherwise it is
skipped with a message. ``--core`` times only deepoffload, torch and DeepSpeed (no checksum=False, no safetensors,
no DCP).
Bound lines compare with raw sequential IO through the op on the same folder (what ``deepoffload bench`` measures:
an O_DIRECT overwrite of an existing file, not synced; a read into memory already touched), and with the least any
checkpoint writer or loader must do: the raw bytes written to a new file, fsynced, renamed over the previous one and
the folder fsynced (durable raw write; and the same with the replaced file freed on a background thread, as
``deepoffload.save`` frees it), and read into new memory (raw read, fresh memory; first-touch page faults
included, as for any loader that returns new tensors). These run interleaved with the methods.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from common import MEMORY_STATES, run_main, settle_memory, write_json

import deepoffload
from deepoffload.bench.measure import BenchError, evict, scratch_file, time_transfer
from deepoffload.bench.sizes import format_size, parse_size
from deepoffload.checkpoint import api as checkpoint_api
from deepoffload.formats.torch_zip.torch_format import record, snapshot
from deepoffload.io import retire
from deepoffload.io.buffers import aligned_empty


def training_state(nbytes: int) -> dict:
    """A model of 2048-wide linear layers and its AdamW state (one real step), about ``nbytes`` in all."""
    width = 2048
    layers = max(1, round(nbytes / (3 * 4 * width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}


def tensors_of(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors_of(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors_of(v, f"{prefix}{i}.")
    elif isinstance(obj, torch.Tensor):
        yield prefix[:-1], obj


def touch(obj) -> None:
    """Read one byte of every page of every tensor (mmap=True defers the reading until the bytes are used)."""
    for _, t in tensors_of(obj):
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict_tree(path: Path) -> None:
    for p in [path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]:
        evict(p)


def deepspeed_fast_writer(config: dict) -> tuple[Callable[[Path], object] | None, str]:
    """A save through DeepSpeed's FastFileWriter with DeepSpeed's own async_io op, set up as DeepSpeed's checkpoint
    writer factory does (64 MiB pinned double buffer, DeepSpeed's aio defaults unless ``config`` overrides) or
    ``(None, why not)``. The op is loaded from where DeepSpeed's JIT build left it, never built here."""
    try:
        import ctypes
        import importlib.machinery
        import importlib.util

        import deepspeed.io.fast_file_writer as ffw
        from torch.utils.cpp_extension import _get_build_directory
    except Exception as e:  # noqa: BLE001 - any import failure means: not available here
        return None, f"DeepSpeed is not importable ({e})"
    so = Path(_get_build_directory("async_io", False)) / "async_io.so"
    pin = Path(_get_build_directory("pin_memory", False)) / "pin_memory.so"  # async_io links against its symbols
    if not so.is_file() or not pin.is_file():
        return None, (
            f"DeepSpeed's async_io op is not built ({so} or {pin} missing; build it once with "
            f"python -c 'from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()', "
            f"which takes minutes)"
        )
    ctypes.CDLL(str(pin), mode=ctypes.RTLD_GLOBAL)
    loader = importlib.machinery.ExtensionFileLoader("async_io", str(so))
    spec = importlib.util.spec_from_file_location("async_io", str(so), loader=loader)
    op = importlib.util.module_from_spec(spec)
    loader.exec_module(op)
    handle = op.aio_handle(
        config.get("block_size", 1 << 20),
        config.get("queue_depth", 8),
        False,
        True,
        config.get("intra_op_parallelism", 1),
    )
    buffer = (
        torch.zeros(64 << 20, dtype=torch.uint8).pin_memory()
        if torch.cuda.is_available()
        else deepoffload.aligned_empty(64 << 20)
    )

    class _NoUtilsOp:  # FastFileWriter loads DeepSpeed's utils op only for save_torch_storage_object_list
        def load(self):
            return self

        def cast_to_byte_tensor(self, *args):
            raise RuntimeError(
                "DeepSpeed's utils op is not built; torch.save through FastFileWriter.write does not use it"
            )

    ffw.UtilsBuilder = _NoUtilsOp

    def save(p: Path):
        if p.exists():
            p.unlink()  # as DeepSpeed's own benchmark does: never overwrite in place
        writer = ffw.FastFileWriter(str(p), ffw.FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=buffer))
        torch.save(state_for_deepspeed[0], writer)
        writer.close()  # drains and fsyncs

    return save, f"DeepSpeed FastFileWriter through its own op ({so})"


state_for_deepspeed: list = [None]
DURABLE = "raw op write, new file+fsync+rename"
DURABLE_BEHIND = "the same, old file freed behind"  # the replaced file freed on a thread, as deepoffload.save does
SAVE_TARGET = 0.9  # deepoffload.save's speed against DURABLE, measured in the same run
FRESH = "raw op read, fresh memory"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument("--size", type=parse_size, default="1G", help="state-dict bytes (default 1G)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core", action="store_true", help="only deepoffload, torch and DeepSpeed")
    parser.add_argument(
        "--memory",
        choices=MEMORY_STATES,
        default="recycled",
        help="free memory's state before each load (see benchmarks/common.py settle_memory)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON (benchmarks/plot.py)")
    args = parser.parse_args()
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp

    import deepoffload.dcp as odcp

    state = training_state(args.size)
    state_for_deepspeed[0] = state
    ds_save, ds_note = deepspeed_fast_writer({})
    print(f"DeepSpeed: {ds_note}" if ds_save else f"DeepSpeed FastFileWriter skipped: {ds_note}")
    flat = {name: t for name, t in tensors_of(state)}
    nbytes = sum(t.nbytes for t in flat.values())
    base = Path(args.path)
    if shutil.disk_usage(base).free < 8 * nbytes:
        raise BenchError(f"{base} needs {8 * nbytes} free bytes for the files of all methods; pass --size smaller")
    folder = Path(tempfile.mkdtemp(prefix=".deepoffload-ckpt-bench-", dir=base))

    def torch_save(p):
        with open(p, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def safetensors_save(p):
        st.save_file(flat, p)
        fsync_path(p)

    def dcp_target():
        return {
            "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
            "optimizer": {
                "state": {
                    i: {k: torch.empty_like(v) for k, v in s.items()} for i, s in state["optimizer"]["state"].items()
                },
                "param_groups": state["optimizer"]["param_groups"],
            },
            "epoch": 0,
        }

    saves: dict[str, tuple[Callable[[Path], object], str]] = {
        "deepoffload.save": (lambda p: deepoffload.save(state, p), "ours.pt"),
        "deepoffload.save checksum=False": (lambda p: deepoffload.save(state, p, checksum=False), "nocrc.pt"),
        "torch.save + fsync": (torch_save, "torch.pt"),
        "safetensors save_file + fsync": (safetensors_save, "st.safetensors"),
        "deepoffload.dcp writer": (
            lambda p: dcp.save(state, storage_writer=odcp.FileSystemWriter(p), no_dist=True),
            "dcp-ours",
        ),
        "DCP FileSystemWriter": (
            lambda p: dcp.save(state, storage_writer=dcp.FileSystemWriter(p), no_dist=True),
            "dcp-theirs",
        ),
    }
    loads: dict[str, tuple[Callable[[Path], object], str]] = {
        "deepoffload.load": (lambda p: deepoffload.load(p), "ours.pt"),
        "torch.load": (lambda p: torch.load(p), "torch.pt"),
        "torch.load mmap=True (+touch)": (lambda p: touch(torch.load(p, mmap=True)), "torch.pt"),
        "safetensors load_file": (lambda p: st.load_file(p), "st.safetensors"),
        "deepoffload.dcp reader": (
            lambda p: dcp.load(dcp_target(), storage_reader=odcp.FileSystemReader(p), no_dist=True),
            "dcp-theirs",
        ),
        "DCP FileSystemReader": (
            lambda p: dcp.load(dcp_target(), storage_reader=dcp.FileSystemReader(p), no_dist=True),
            "dcp-theirs",
        ),
    }
    if ds_save is not None:
        saves["DeepSpeed FastFileWriter"] = (ds_save, "ds.pt")
    raw_io: dict = {}  # the raw buffer and handle, once made

    def durable_raw_write(p: Path, behind: bool = False):
        temporary = p.with_name(p.name + ".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            raw_io["handle"].write(raw_io["buffer"], temporary, truncate=False)
            os.fsync(fd)
        finally:
            os.close(fd)
        (retire.replace if behind else os.replace)(str(temporary), str(p))
        fsync_path(p.parent)

    def raw_read_fresh(p: Path):
        data = aligned_empty(nbytes, pin=False)  # what the loader's whole-file read uses
        raw_io["handle"].read(data, raw_io["path"])
        return data

    saves[DURABLE] = (durable_raw_write, "raw-durable.bin")
    saves[DURABLE_BEHIND] = (lambda p: durable_raw_write(p, behind=True), "raw-behind.bin")
    loads[FRESH] = (raw_read_fresh, "raw-fresh")
    if args.core:
        for table in (saves, loads):
            for name in [n for n in table if "safetensors" in n or "DCP" in n or "dcp" in n or "checksum" in n]:
                del table[name]
    seconds: dict[str, list[float]] = {name: [] for name in [*saves, *loads, "raw op write", "raw op read"]}
    blocked, inside, copy, snap, kept = [], [], [], [], []
    real_snapshot = checkpoint_api.snapshot

    def timed_snapshot(*a):  # the copy inside save_async, timed in the same call
        start = time.perf_counter()
        try:
            return real_snapshot(*a)
        finally:
            inside.append(time.perf_counter() - start)

    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    warnings.filterwarnings("ignore", "Detected an existing checkpoint")
    try:
        raw = deepoffload.aligned_empty(nbytes)
        raw.fill_(1)  # touched: the raw op lines measure the disk, not first-touch page faults
        with scratch_file(folder, nbytes) as raw_path, deepoffload.AsyncIOHandle() as handle:
            raw_io.update(buffer=raw, handle=handle, path=raw_path)
            handle.write(raw, raw_path)  # the file the raw reads read, written before the first of them
            for r in range(args.rounds):
                order = list(saves)
                order = order[r % len(order) :] + order[: r % len(order)]
                for name in order:
                    run, file = saves[name]
                    start = time.perf_counter()
                    run(folder / file)
                    seconds[name].append(time.perf_counter() - start)
                    retire.wait()  # a replaced file freed behind a save is freed before the next method is timed
                    evict_tree(folder / file)
                seconds["raw op write"].append(time_transfer(handle, "write", raw, raw_path, True).seconds)
                order = list(loads)
                order = order[r % len(order) :] + order[: r % len(order)]
                for name in order:
                    run, file = loads[name]
                    evict_tree(folder / file)
                    settle_memory(args.memory, nbytes)
                    start = time.perf_counter()
                    run(folder / file)
                    seconds[name].append(time.perf_counter() - start)
                seconds["raw op read"].append(time_transfer(handle, "read", raw, raw_path, True).seconds)
                start = time.perf_counter()
                checkpoint_api.snapshot = timed_snapshot
                try:
                    future = deepoffload.save_async(state, folder / "async.pt")
                finally:
                    checkpoint_api.snapshot = real_snapshot
                blocked.append(time.perf_counter() - start)
                future.result()
                start = time.perf_counter()
                copies = [t.clone() for t in flat.values()]
                copy.append(time.perf_counter() - start)
                del copies
                start = time.perf_counter()
                arena = snapshot(record(state))  # the copy save_async makes, alone, into new memory
                snap.append(time.perf_counter() - start)
                del arena
                start = time.perf_counter()
                arena = snapshot(record(state), checkpoint_api._arena)  # into the memory it keeps
                kept.append(time.perf_counter() - start)
                del arena
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    print(
        f"checkpoint: {format_size(nbytes)} state dict ({len(flat)} tensors, model + AdamW), {args.rounds} rounds "
        f"interleaved, cold cache, free memory {args.memory} before each load, saves include fsync; "
        f"GB/s = 1e9 bytes/s; ratio = median of per-round "
        f"ratios deepoffload/method (time of method / time of ours)"
    )
    for group, ours in (
        (list(saves) + ["raw op write"], "deepoffload.save"),
        (list(loads) + ["raw op read"], "deepoffload.load"),
    ):
        print(f"{'method':<34}{'GB/s':>8}{'ours/this':>11}   per-round ratios")
        for name in group:
            ratios = [b / a for a, b in zip(seconds[ours], seconds[name])]
            print(
                f"{name:<34}{nbytes / statistics.median(seconds[name]) / 1e9:8.3f}{statistics.median(ratios):11.2f}"
                f"   " + " ".join(f"{x:.2f}" for x in ratios)
            )
        pairs = (
            [("deepoffload.dcp writer", "DCP FileSystemWriter")]
            if ours == "deepoffload.save"
            else [("deepoffload.dcp reader", "DCP FileSystemReader")]
        )
        for a, b in pairs:
            if a in seconds and seconds[a]:
                ratios = [y / x for x, y in zip(seconds[a], seconds[b])]
                print(f"  {a} / {b}: {statistics.median(ratios):.2f}")
        raws, baseline = (
            (("raw op write", DURABLE, DURABLE_BEHIND), "torch.save + fsync")
            if ours == "deepoffload.save"
            else (("raw op read", FRESH), "torch.load")
        )
        for raw in raws:
            bound = [b / r for r, b in zip(seconds[raw], seconds[baseline])]
            ours_vs_raw = [r / o for r, o in zip(seconds[raw], seconds[ours])]
            print(
                f"  bound: {baseline} / {raw} = {statistics.median(bound):.2f} (per round "
                + " ".join(f"{x:.2f}" for x in bound)
                + f"); {ours} speed / its speed = "
                f"{statistics.median(ours_vs_raw):.2f} (per round " + " ".join(f"{x:.2f}" for x in ours_vs_raw) + ")"
            )
            if raw in (DURABLE, DURABLE_BEHIND):  # the target: a save at 0.9 of what any durable writer must do
                verdict = "meets" if statistics.median(ours_vs_raw) >= SAVE_TARGET else "misses"
                print(f"  target: {ours} speed >= {SAVE_TARGET} x {raw}: {verdict} it")
    if args.json:
        write_json(
            args.json,
            "checkpoint",
            f"Checkpoints: {format_size(nbytes)} state dict, time of the method / time of deepoffload's",
            json_results(
                seconds,
                [
                    (list(saves) + ["raw op write"], "deepoffload.save"),
                    (list(loads) + ["raw op read"], "deepoffload.load"),
                ],
            ),
        )
    print(
        "save_async blocked s per round (the first call allocates its arena): " + " ".join(f"{b:.3f}" for b in blocked)
    )
    print(
        "  of which its snapshot copy: " + " ".join(f"{b:.3f}" for b in inside) + "; the rest (pickling, waiting, "
        "allocating): " + " ".join(f"{b - c:.3f}" for b, c in zip(blocked, inside))
    )
    print(
        "  the same snapshot copy alone, into new memory: "
        + " ".join(f"{b:.3f}" for b in snap)
        + "; into the arena save_async keeps: "
        + " ".join(f"{b:.3f}" for b in kept)
        + "; cloning every tensor: "
        + " ".join(f"{b:.3f}" for b in copy)
    )
    print(
        "  blocked / snapshot into kept arena, per round: "
        + " ".join(f"{b / c:.2f}" for b, c in zip(blocked, kept))
        + "; blocked / snapshot into new memory: "
        + " ".join(f"{b / c:.2f}" for b, c in zip(blocked, snap))
    )
    return 0


def json_results(seconds: dict[str, list[float]], groups: list[tuple[list[str], str]]) -> list[dict]:
    """Each method's time over deepoffload's (median of per-round ratios; above 1: ours is faster), against the
    project's targets: 3x torch.save + fsync, 1.5x torch.load, and our speed at least 0.9x the raw op's (0.9)."""
    targets = {
        "torch.save + fsync": 3.0,
        "torch.load": 1.5,
        DURABLE: 0.9,
        DURABLE_BEHIND: 0.9,
        FRESH: 0.9,
        "raw op read": 0.9,
    }
    results = []
    for names, ours in groups:
        for name in names:
            if name == ours or not seconds[name]:
                continue
            ratios = [b / a for a, b in zip(seconds[ours], seconds[name])]
            results.append(
                {
                    "label": f"{name} / {ours}",
                    "value": round(statistics.median(ratios), 3),
                    "bound": targets.get(name),
                    "per_round": [round(r, 3) for r in ratios],
                }
            )
    return results


if __name__ == "__main__":
    run_main("checkpoint", main)
