"""Where the time of an offloaded training step goes: a timeline of one ``step_in_backward`` (or default-mode) step.

Instruments the optimizer's pipeline (read and write submit, completion polled every ms by a helper thread, waits
of the training thread, staging-buffer acquisition, the wrapped optimizer's compute, heap trims) and the model's
forward and backward, then prints per-category totals of the training thread's time, the disk's busy time (the
union of in-flight transfers) and, with ``--events``, every event.

    python benchmarks/optimizer_timeline.py [--model mlp|llama] [--mlp-width 4096] [--mlp-layers 8] [--steps 2]
        [--default-mode] [--events]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T0 = time.perf_counter()
spans: dict[str, float] = collections.defaultdict(float)  # training-thread seconds per category (outermost only)
events: list[tuple[float, str]] = []
transfers: list[list] = []  # [kind, nbytes, submitted, completed or None]
_depth = threading.local()


def now() -> float:
    return time.perf_counter() - T0


def timed(category: str, fn, outer: bool = False):
    """``fn`` with its training-thread time added to ``category``; inner (not ``outer``) categories count only the
    outermost timed call among them."""

    def wrapper(*args, **kwargs):
        depth = 0 if outer else getattr(_depth, "n", 0)
        start = now()
        if not outer:
            _depth.n = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            if not outer:
                _depth.n = depth
            if depth == 0:
                spans[category] += now() - start
                events.append((start, f"{category} {1e3 * (now() - start):.1f} ms"))

    return wrapper


def instrument() -> None:
    from deepoffload.io import handle as handle_module
    from deepoffload.swap import optimizer_pipeline as pipeline_module
    from deepoffload.swap import pool as pool_module
    from deepoffload.swap import staging_buffers as staging_module
    from deepoffload.swap import tensor_swapper as ts

    def submitting(kind: str, fn):
        def wrapper(self, tensor, *args, **kwargs):
            request = fn(self, tensor, *args, **kwargs)
            transfers.append([kind, tensor.numel() * tensor.element_size(), now(), None, request])
            events.append((now(), f"submit {kind} {tensor.numel() * tensor.element_size() / 1e6:.0f} MB"))
            return request

        return wrapper

    cls = handle_module.AsyncIOHandle
    cls.read_async = submitting("read", cls.read_async)
    cls.write_async = submitting("write", cls.write_async)
    ts.SwapOut.wait = timed("wait write", ts.SwapOut.wait)
    staging = staging_module.StagingBuffers
    staging.acquire = timed("(within the above) acquire buffer", staging.acquire, True)
    pool_module.aligned_empty = timed("(within the above) allocate buffer", pool_module.aligned_empty, True)
    ts.SwapIn.wait_io = timed("(within the above) wait read", ts.SwapIn.wait_io, True)
    pipeline = pipeline_module.ChunkPipeline
    pipeline.step_chunk = timed("optimizer compute", pipeline.step_chunk)
    pipeline_module.trim_heap = timed("malloc_trim", pipeline_module.trim_heap)
    pipeline.restore = timed("restore", pipeline.restore)
    pipeline.write = timed("write submit", pipeline.write)
    pipeline.read = timed("read submit", pipeline.read)

    def poll() -> None:
        while True:
            for t in transfers:
                try:
                    finished = t[3] is None and t[4].done()
                except ValueError:  # collected by a wait meanwhile (racing this poll): it is done
                    finished = t[3] is None
                if finished:
                    t[3] = now()
                    events.append((t[3], f"done {t[0]} {t[1] / 1e6:.0f} MB ({1e3 * (t[3] - t[2]):.0f} ms)"))
            time.sleep(0.001)

    threading.Thread(target=poll, daemon=True).start()


def busy(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1.0
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "llama"), default="mlp")
    parser.add_argument("--mlp-width", type=int, default=4096)
    parser.add_argument("--mlp-layers", type=int, default=8)
    parser.add_argument("--llama-hidden", type=int, default=256)
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--llama-vocab", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the first (which creates the state)")
    parser.add_argument("--default-mode", action="store_true", help="step in step(), not in backward")
    parser.add_argument("--chunk-mb", type=int, default=None, help="SwapConfig.chunk_bytes in MiB")
    parser.add_argument("--events", action="store_true")
    parser.add_argument("--folder", default=None)
    args = parser.parse_args()
    import torch
    from optimizer_overlap import llama, mlp

    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

    instrument()
    model, loss_of = (
        mlp(args.mlp_width, args.mlp_layers)
        if args.model == "mlp"
        else llama(args.llama_hidden, args.llama_layers, args.llama_vocab)
    )
    folder = tempfile.mkdtemp(prefix="timeline-", dir=args.folder or os.getcwd())
    config = SwapConfig(folder=folder)
    if args.chunk_mb:
        config = config.replace(chunk_bytes=args.chunk_mb << 20)
    opt = OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=1e-4)
    if not args.default_mode:
        opt.step_in_backward()
    for step in range(1 + args.steps):
        spans.clear()
        events.clear()
        del transfers[:]
        start = now()
        loss = timed("forward", loss_of, True)(model)
        events.append((now(), "backward starts"))
        timed("backward (incl. steps in it)", loss.backward, True)()
        events.append((now(), "step() starts"))
        timed("step()", opt.step, True)()
        opt.zero_grad()
        end = now()
        time.sleep(0.01)
        if step == 0:
            continue
        total = end - start
        print(f"step {step}: {total * 1e3:.0f} ms")
        inner = {
            k: v
            for k, v in spans.items()
            if k not in ("forward", "backward (incl. steps in it)", "step()") and not k.startswith("(")
        }
        nested = {k: v for k, v in spans.items() if k.startswith("(")}
        outer = {k: spans[k] for k in ("forward", "backward (incl. steps in it)", "step()")}
        for k, v in outer.items():
            print(f"  {k:32s} {v * 1e3:7.0f} ms")
        for k, v in sorted(inner.items(), key=lambda kv: -kv[1]):
            print(f"    {k:30s} {v * 1e3:7.0f} ms")
        print(
            f"    {'backward compute (rest)':30s} "
            f"{(sum(outer.values()) - sum(inner.values()) - outer['forward']) * 1e3:7.0f} ms  (incl. Python)"
        )
        for k, v in nested.items():
            print(f"    {k:30s} {v * 1e3:7.0f} ms")
        for kind in ("read", "write"):
            done = [(a, b if b is not None else end) for k, _, a, b, _ in transfers if k == kind]
            nbytes = sum(n for k, n, *_ in transfers if k == kind)
            print(
                f"  disk {kind}s: {len(done)} of {nbytes / 1e6:.0f} MB, busy {busy(done) * 1e3:.0f} ms "
                f"({nbytes / 1e9 / max(busy(done), 1e-9):.2f} GB/s while busy)"
            )
        both = [(a, b if b is not None else end) for _, _, a, b, _ in transfers]
        print(f"  disk busy (either): {busy(both) * 1e3:.0f} ms of {total * 1e3:.0f} ms")
        if args.events:
            for t, what in sorted(events):
                print(f"    {1e3 * (t - start):8.1f}  {what}")
    opt.close()
    os.rmdir(folder) if os.path.isdir(folder) and not os.listdir(folder) else None


if __name__ == "__main__":
    main()
