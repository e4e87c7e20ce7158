"""Whole training steps (forward, backward, AdamW step) with the optimizer state in memory, offloaded and stepped in
``step()``, and offloaded with ``step_in_backward()``; the step's IO alone: the offloaded optimizer's own extents of
its pack file (same file, offsets and request sizes) read into reused buffers and each written back as soon as it is
in, reads kept as far ahead as the step keeps them, so reads and writes share the disk as in the step; and the
in-memory step with that IO running alongside it in another thread, which measures what the IO costs the compute on
this machine (on a VM the host's IO work shows as steal time taken from the guest's cores). Interleaved A B C D E,
for a tiny Hugging Face Llama built from a config and for an MLP (``--mlp-width 4096``: 1.07 GB of AdamW state).

Per variant: median wall time, the AdamW compute inside it (the wrapped optimizer's own ``step`` calls), the process's
CPU time (user + sys, all threads), the machine's steal time and the rest of the machine's busy CPU time (other
processes, interrupts: load that disturbs the figures), all per step, from /proc/stat and ``os.times``.

    python benchmarks/optimizer_overlap.py [--rounds 3] [--folder DIR [--folder DIR2]] [--models llama,mlp]
        [--mlp-width 1536] [--mlp-layers 8] [--compute-threads 1] [--json PATH]

The step's bound is the larger of the in-memory step and the IO alone (the raw read plus write of the state's bytes
through the op), both measured in the same round: each offloaded step is divided by its own round's bound, and the
median of those ratios is reported (target 1.05, issue 41). Two or more ``--folder`` spread the state over those
drives (``SwapConfig(folder=[...])``) and the IO alone then reads and writes every drive's extents through its own
queue, as the step does. ``--json PATH`` writes each offloaded mode's step over its bound (target 1.05), over the
in-memory step, and over the in-memory step with the IO alongside (the IO's own CPU cost on this machine), for
``benchmarks/plot.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402


def llama(hidden: int, layers: int, vocab: int):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def mlp(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(layers)]
    )
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(0))
    return model, lambda m: m(x).square().mean()


def extents_of(opt) -> list:
    """The extents of ``opt``'s pack files, in file order (drives interleaved, as the step's chunks are)."""
    return sorted({id(e): e for e in opt.swapper.packing.extents.values()}.values(), key=lambda e: e.offset)


def io_buffers(opt, ahead: int) -> list:
    """``ahead + 2`` buffers of the largest extent's bytes, faulted in (as the step's pooled buffers are)."""
    from deepoffload.io.buffers import aligned_empty

    largest = max(e.nbytes for e in extents_of(opt))
    buffers = [aligned_empty(largest) for _ in range(ahead + 2)]
    for b in buffers:
        b.fill_(0)
    return buffers


def step_io(opt, ahead: int, buffers: list) -> float:
    """Seconds to read every extent of ``opt``'s pack files (in file order) and write each back from its buffer as
    soon as it is in, ``ahead`` reads in flight beyond the one waited for, as the step's pipeline does without its
    compute, each through its drive's own handle (the swapper's). ``buffers`` (``io_buffers``) are reused."""
    extents = extents_of(opt)
    free = list(buffers)
    of = opt.swapper.io.of
    reads, writes = [], []  # (request, buffer)
    start = time.perf_counter()
    for k, extent in enumerate(extents):
        while len(reads) <= ahead and k + len(reads) < len(extents):
            if not free:
                request, buffer = writes.pop(0)
                request.wait()
                free.append(buffer)
            e, buffer = extents[k + len(reads)], free.pop()
            reads.append((of(e.pack.path).read_async(buffer[: e.nbytes], e.pack.path, e.offset), buffer))
        request, buffer = reads.pop(0)
        request.wait()
        path = extent.pack.path
        writes.append((of(path).write_async(buffer[: extent.nbytes], path, extent.offset, truncate=False), buffer))
        while writes and writes[0][0].done():
            request, buffer = writes.pop(0)
            request.wait()
            free.append(buffer)
    for request, _ in writes:
        request.wait()
    return time.perf_counter() - start


ALONGSIDE = "in memory + IO"


def cpu_seconds() -> float:
    """This process's CPU time so far (user + sys, all threads), seconds."""
    times = os.times()
    return times.user + times.system


def machine_seconds() -> tuple[float, float]:
    """The machine's busy CPU time (all cores, steal excluded) and steal time so far, seconds (zeros without
    /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    steal = ticks[7] if len(ticks) > 7 else 0
    return (sum(ticks[:8]) - idle - steal) / hz, steal / hz


def compare(name: str, build, rounds: int, folder: str | list[str], threads: int | None = None) -> list[dict]:
    import torch

    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

    config = SwapConfig(folder=folder)
    runs = {}
    adamw: dict[str, float] = {}  # variant -> seconds in the AdamW math this step

    def timing(variant: str, step):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                adamw[variant] = adamw.get(variant, 0.0) + time.perf_counter() - start

        return timed

    offloaded_variants = ["offloaded", "step_in_backward"]
    if threads is not None:
        offloaded_variants += [f"offloaded, {threads} thr", f"step_in_backward, {threads} thr"]
    for variant in ("in memory", *offloaded_variants, ALONGSIDE):
        model, loss_of = build()
        if variant in ("in memory", ALONGSIDE):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            runs[variant] = (model, loss_of, opt, timing(variant, opt.step))
            continue
        opt = OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=1e-4)
        opt.pipeline.inner_step = timing(
            variant, opt.pipeline.inner_step
        )  # the wrapped AdamW's own step, chunk by chunk
        if variant.startswith("step_in_backward"):
            opt.step_in_backward()
        if variant.endswith(" thr"):
            opt.compute_threads = threads
        runs[variant] = (model, loss_of, opt, opt.step)

    def train_step(variant: str) -> float:
        model, loss_of, opt, step = runs[variant]
        start = time.perf_counter()
        loss_of(model).backward()
        step()
        opt.zero_grad()
        return time.perf_counter() - start

    for variant in runs:  # first steps create the state
        train_step(variant)
    state = sum(
        t.numel() * t.element_size()
        for s in runs["in memory"][2].state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    offloaded = runs["offloaded"][2]
    ahead = max(1, config.buffer_count - 2)
    buffers = io_buffers(offloaded, ahead)
    order = ("in memory", *offloaded_variants, "IO alone", ALONGSIDE)
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in order}
    for _ in range(rounds):
        for variant in order:
            adamw.clear()
            cpu, (busy, steal) = cpu_seconds(), machine_seconds()
            start = time.perf_counter()
            if variant == "IO alone":
                step_io(offloaded, ahead, buffers)
            elif variant == ALONGSIDE:
                io = threading.Thread(target=step_io, args=(offloaded, ahead, buffers))
                io.start()
                train_step(variant)
                io.join()
            else:
                train_step(variant)
            wall = time.perf_counter() - start
            cpu, (busy, steal) = cpu_seconds() - cpu, [b - a for a, b in zip((busy, steal), machine_seconds())]
            samples[variant].append(
                {
                    "wall": wall,
                    "adamw": adamw.get(variant, 0.0),
                    "cpu": cpu,
                    "steal": steal,
                    "others": max(0.0, busy - cpu),
                }
            )
    same = all(
        torch.equal(a, b) for a, b in zip(runs["in memory"][0].parameters(), runs["step_in_backward"][0].parameters())
    )
    for variant in offloaded_variants:
        runs[variant][2].close()
    m = {v: {k: statistics.median(s[k] for s in rows) for k in rows[0]} for v, rows in samples.items()}
    wall = {v: [s["wall"] for s in rows] for v, rows in samples.items()}
    params = sum(p.numel() for p in runs["in memory"][0].parameters())
    print(
        f"{name}: {params / 1e6:.1f}M parameters, {state / 1e6:.0f} MB of AdamW state, {rounds} rounds; "
        f"medians per step, seconds"
    )
    print(
        f"  {'':24s}{'wall':>7s}{'AdamW':>7s}{'CPU':>7s}{'steal':>7s}{'others':>7s}   (CPU: this process, user + "
        f"sys; steal: the machine's; others: the machine's other busy CPU)"
    )
    for variant, f in m.items():
        print(f"  {variant:24s}" + "".join(f"{f[k]:7.2f}" for k in ("wall", "adamw", "cpu", "steal", "others")))
    bound = [max(a, b) for a, b in zip(wall["in memory"], wall["IO alone"])]  # per round
    print(
        f"  bound max(in memory, IO alone) per round {' '.join(f'{b:.2f}' for b in bound)} (the IO alone "
        f"{statistics.median(wall['IO alone']) / statistics.median(wall['in memory']):.2f}x the in-memory step)"
    )
    print(
        f"  the IO alongside costs the in-memory step {m[ALONGSIDE]['wall'] / m['in memory']['wall']:.2f}x "
        f"(per round {' '.join(f'{a / b:.2f}' for a, b in zip(wall[ALONGSIDE], wall['in memory']))})"
    )
    over_bound = {}
    for variant in offloaded_variants:
        rounds_ = [a / b for a, b in zip(wall[variant], bound)]
        over_bound[variant] = rounds_
        print(
            f"  {variant}: / its round's max(in memory, IO alone) {statistics.median(rounds_):.3f}x (target 1.05x; "
            f"per round {' '.join(f'{r:.2f}' for r in rounds_)}), / in memory with the IO alongside "
            f"{m[variant]['wall'] / m[ALONGSIDE]['wall']:.2f}x"
        )
    print(f"  step_in_backward parameters identical to in memory: {same}")
    results = []
    for variant in offloaded_variants:
        results.append(
            {
                "label": f"{name}: {variant} / max(in memory, IO alone)",
                "value": round(statistics.median(over_bound[variant]), 3),
                "bound": 1.05,
                "higher_is_better": False,
                "per_round": [round(r, 3) for r in over_bound[variant]],
            }
        )
    results.append(
        {
            "label": f"{name}: IO alone / in memory",
            "value": round(statistics.median(wall["IO alone"]) / statistics.median(wall["in memory"]), 3),
            "higher_is_better": False,
        }
    )
    results.append(
        {
            "label": f"{name}: in memory with the IO alongside / in memory",
            "value": round(m[ALONGSIDE]["wall"] / m["in memory"]["wall"], 3),
            "higher_is_better": False,
        }
    )
    for variant in offloaded_variants:
        results.append(
            {
                "label": f"{name}: {variant} / in memory with its IO alongside",
                "value": round(m[variant]["wall"] / m[ALONGSIDE]["wall"], 3),
                "bound": 1.0,
                "higher_is_better": False,
            }
        )
    return results


def mlp_state_bytes(args) -> int:
    """The MLP's AdamW state (two float32 moments per parameter, weights and biases)."""
    return 2 * 4 * args.mlp_layers * (args.mlp_width * args.mlp_width + args.mlp_width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--folder",
        action="append",
        default=None,
        help="a folder on the drive to measure; twice or more: several drives",
    )
    parser.add_argument("--models", default="llama,mlp", help="which models, comma-separated (llama, mlp)")
    parser.add_argument("--llama-hidden", type=int, default=256)
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--llama-vocab", type=int, default=8000)
    parser.add_argument("--mlp-width", type=int, default=1536)
    parser.add_argument("--mlp-layers", type=int, default=8)
    parser.add_argument(
        "--compute-threads",
        type=int,
        default=None,
        help="also both offloaded modes with this compute_threads (torch's intra-op threads)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON (benchmarks/plot.py)")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = set(models) - {"llama", "mlp"}
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; expected llama and/or mlp")
    folders = [tempfile.mkdtemp(prefix="overlap-", dir=base) for base in args.folder or [os.getcwd()]]
    folder = folders if len(folders) > 1 else folders[0]
    try:
        results = []
        if "llama" in models:
            results += compare(
                "tiny Llama",
                lambda: llama(args.llama_hidden, args.llama_layers, args.llama_vocab),
                args.rounds,
                folder,
                args.compute_threads,
            )
        if "mlp" in models:
            results += compare(
                "MLP", lambda: mlp(args.mlp_width, args.mlp_layers), args.rounds, folder, args.compute_threads
            )
        if args.json:
            write_json(
                args.json,
                "optimizer_overlap",
                "Offloaded AdamW step / its bound, max(in-memory step, raw read + write of its state)"
                + (
                    f" (MLP {args.mlp_layers} x {args.mlp_width}: {mlp_state_bytes(args) / 1e9:.2f} GB of AdamW state)"
                    if "mlp" in models
                    else ""
                ),
                results,
                unit="step time / bound (lower is better)",
            )
    finally:
        import shutil

        for made in folders:
            shutil.rmtree(made, ignore_errors=True)


if __name__ == "__main__":
    main()
