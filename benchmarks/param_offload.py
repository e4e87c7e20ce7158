"""Parameter offload: forward+backward+step time streamed (fused mode, prefetch 1) against in memory and against the
pure IO time of the bytes a streamed step moves, interleaved A B C A B C in one run; then peak RSS streamed vs in
memory for two model sizes, each in its own process, under glibc's default allocator settings and with
MALLOC_MMAP_THRESHOLD_=1048576: by default glibc raises its mmap threshold (up to 32 MiB) each time a large mmapped
block is freed, after which same-sized tensors (a block's gradients, activations and temporaries, allocated by torch
through malloc) come from the heap, and memory freed there is kept by the process rather than given back; a fixed
1 MiB threshold maps and unmaps every large tensor, so RSS shows what is actually in use. Both rows are printed.

    python benchmarks/param_offload.py [--folder DIR] [--steps N] [--checksum] [--no-rss]

Target: streamed <= 1.2 x max(compute, IO). The disk and the 2 cores are shared: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn


def make_model(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(depth)]
    )


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def timing(folder: str, steps: int, width: int, depth: int, batch: int, checksum: bool = False) -> None:
    from deepoffload import StreamOptions, TrainOptions
    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.params import offload_parameters
    from deepoffload.swap.tensor_swapper import TensorSwapper

    reference, model = make_model(width, depth), make_model(width, depth)
    optimizer = adam(reference.parameters())
    config = SwapConfig(folder=folder)
    offload = offload_parameters(
        model, config=config, train=TrainOptions(optimizer=adam), stream=StreamOptions(prefetch=1)
    )
    hashed_model = make_model(width, depth)  # --checksum: the same, every swapped tensor hashed and checked
    hashed = (
        offload_parameters(
            hashed_model,
            config=config.replace(checksum=True),
            train=TrainOptions(optimizer=adam),
            stream=StreamOptions(prefetch=1),
        )
        if checksum
        else None
    )
    x = torch.randn(batch, width)
    block = {f"t{i}": p.detach().clone() for i, p in enumerate(reference[0].parameters())}
    io = TensorSwapper(config.replace(chunk_bytes=offload.stats.block_bytes, buffer_count=4))

    def in_memory():
        optimizer.zero_grad()
        reference(x).square().mean().backward()
        optimizer.step()

    def streamed():
        model(x).square().mean().backward()
        offload.step()
        offload.zero_grad()

    def streamed_checksum():
        assert hashed is not None
        hashed_model(x).square().mean().backward()
        hashed.step()
        hashed.zero_grad()

    moved = {}

    def pure_io():
        """The bytes a streamed step reads and writes, in block-sized files, reads 2 ahead, writes 2 behind."""
        read_bytes, written_bytes = moved["read"], moved["written"]
        nbytes = io.stored_bytes("g0") if io.records("g0") else 0
        if not nbytes:
            for i in range(4):
                io.swap_out({f"g{i}": block}).wait()
            nbytes = io.stored_bytes("g0")
        reads, writes = [], []
        for k in range(max(read_bytes, written_bytes) // nbytes):
            if k * nbytes < read_bytes:
                reads.append(io.swap_in([f"g{k % 4}"]))
            if k * nbytes < written_bytes:
                writes.append(io.swap_out({f"g{(k + 2) % 4}": block}))
            while len(reads) > 2:
                reads.pop(0).release()
            while len(writes) > 2:
                writes.pop(0).wait()
        for r in reads:
            r.wait()
            r.release()
        for w in writes:
            w.wait()

    streamed()  # warm up both (the first step creates the optimizer state), then measure one streamed step's bytes
    in_memory()
    before = offload.stats
    streamed()
    after = offload.stats
    moved["read"] = after.bytes_read - before.bytes_read + after.state_bytes_read - before.state_bytes_read
    moved["written"] = (
        after.bytes_written - before.bytes_written + after.state_bytes_written - before.state_bytes_written
    )
    pure_io()
    runs = [("in memory", in_memory), ("streamed", streamed), ("pure IO", pure_io)]
    if checksum:
        streamed_checksum()  # its warm-up
        runs.append(("checksum", streamed_checksum))
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    for step in range(steps):
        for name, run in runs[step % len(runs) :] + runs[: step % len(runs)]:
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    offload.close(restore=False)
    if hashed is not None:
        hashed.close(restore=False)
    io.close()
    median = {name: statistics.median(values) for name, values in times.items()}
    params = sum(p.numel() for p in reference.parameters())
    print(
        f"model: {depth} blocks, {params:,} parameters ({params * 4 / 1e6:.0f} MB fp32), batch {batch}; a streamed "
        f"step moves {moved['read'] / 1e6:.0f} MB in, {moved['written'] / 1e6:.0f} MB out (weights and Adam state)"
    )
    for name, value in median.items():
        print(f"  {name:10s} median {value * 1e3:8.1f} ms over {steps} interleaved steps")
    bound = max(median["in memory"], median["pure IO"])
    print(
        f"  streamed / max(compute, IO) = {median['streamed'] / bound:.2f} (target <= 1.2); "
        f"streamed / in memory = {median['streamed'] / median['in memory']:.2f}; "
        f"IO rate of pure IO: {(moved['read'] + moved['written']) / median['pure IO'] / 1e9:.2f} GB/s (1e9 B/s)"
    )


def rss_child(folder: str, width: int, depth: int, streamed: bool) -> None:
    """One process: build, offload (or not), train 2 steps, print the peak RSS (bytes) over the training steps."""
    import ctypes
    import threading

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    model = make_model(width, depth)
    x = torch.randn(8, width)
    if streamed:
        from deepoffload import StreamOptions, TrainOptions
        from deepoffload.swap.config import SwapConfig
        from deepoffload.swap.params import offload_parameters

        offload = offload_parameters(
            model,
            config=SwapConfig(folder=folder),
            train=TrainOptions(optimizer=adam),
            stream=StreamOptions(prefetch=1),
        )
        step = lambda: (model(x).square().mean().backward(), offload.step(), offload.zero_grad())  # noqa: E731
    else:
        optimizer = adam(model.parameters())
        step = lambda: (model(x).square().mean().backward(), optimizer.step(), optimizer.zero_grad())  # noqa: E731
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give back what building the model freed: measure what training needs
    start = rss()
    peak, stop = [start], threading.Event()

    def sample():
        while not stop.wait(0.002):
            peak[0] = max(peak[0], rss())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    for _ in range(2):
        step()
    stop.set()
    thread.join()
    print(json.dumps({"peak_rss": peak[0], "start_rss": start}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=None, help="where swap files go (default: a temp folder on /tmp)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--rss-child", nargs=3, type=int, metavar=("WIDTH", "DEPTH", "STREAMED"), help=argparse.SUPPRESS
    )
    parser.add_argument("--tiny", action="store_true", help="width 64, 2 blocks, one allocator setting (a smoke run)")
    parser.add_argument("--checksum", action="store_true", help="also time a streamed step with checksum=True")
    parser.add_argument("--no-rss", action="store_true", help="only the step times")
    args = parser.parse_args()
    folder = args.folder or tempfile.mkdtemp(prefix="param-offload-bench-", dir="/tmp")
    if args.rss_child:
        rss_child(folder, *args.rss_child[:2], bool(args.rss_child[2]))
        return 0
    torch.set_num_threads(os.cpu_count() or 1)
    print("time per training step (the machine's 2 cores and disk are shared with other engineers: noisy)")
    width, depths = (64, (2,)) if args.tiny else (768, (6, 18))
    timing(
        folder,
        args.steps,
        width=width,
        depth=2 if args.tiny else 8,
        batch=8 if args.tiny else 256,
        checksum=args.checksum,
    )
    if args.no_rss:
        return 0
    print("peak RSS during 2 training steps (own process each; Adam; fused mode, prefetch 1)")
    settings = (("glibc default", None), ("MALLOC_MMAP_THRESHOLD_=1048576", "1048576"))
    for label, threshold in settings[:1] if args.tiny else settings:
        env = dict(os.environ)
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        if threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = threshold
        print(f" {label}:")
        for depth in depths:
            row = {}
            for streamed in (False, True):
                child = ["--rss-child", str(width), str(depth), str(int(streamed))]
                out = subprocess.run(
                    [sys.executable, __file__, "--folder", folder, *child],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
                row[streamed] = json.loads(out.stdout.strip().splitlines()[-1])
            params = depth * 2 * (width * 4 * width) + depth * (5 * width)
            print(
                f"  {depth:2d} blocks ({params * 4 / 1e6:5.0f} MB of fp32 weights): peak in memory "
                f"{row[False]['peak_rss'] / 1e6:6.0f} MB, streamed {row[True]['peak_rss'] / 1e6:6.0f} MB (RSS before "
                f"the first step: {row[False]['start_rss'] / 1e6:.0f} MB and {row[True]['start_rss'] / 1e6:.0f} MB)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
