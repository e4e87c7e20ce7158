"""Tiny Hugging Face Llama (hidden 512, 8 layers, random weights) streamed by ``offload_parameters`` against the
same model in memory and against accelerate's disk offload, interleaved A B A B:

1. training step time (forward + backward + Adam step, fused mode, prefetch 1) and peak RSS while training, streamed
   vs in memory: each (variant, round) in its own process, RSS sampled every millisecond during the steps (the model
   is built in memory before it is offloaded, so the process's all-time high-water mark would show that instead),
   with MALLOC_MMAP_THRESHOLD_=1048576 so that RSS shows memory in use rather than what glibc keeps (see
   docs/concepts/memory-bounds.md, the allocator);
2. forward and ``generate(20)`` (greedy, KV cache) time, deepoffload vs accelerate ``dispatch_model`` with every
   decoder layer on "disk" (embeddings, final norm and head in memory for both), in one process; the outputs of both
   are checked equal to the in-memory model's;
3. ``--part budget``: ``generate(20)`` at equal resident memory: deepoffload with ``max_resident_bytes`` of K
   decoder layers against accelerate with the first K layers on "cpu" and the rest on "disk", K = 0, 4, 8 (of 8);
   outputs checked equal to the in-memory model's;
4. ``--part train-budget``: training step time (``--mode`` fused or grads, Adam, optimizer state offloaded in all
   three) with ``max_resident_bytes`` of 0, 4 and 8 decoder layers, in one process, one step of each per round in
   rotating order; prints each budget's step time over budget 0's, its parameter and gradient bytes read and written
   per step and the time the step waited on them, and the optimizer state bytes; losses checked equal across the
   three;
5. ``--part serve``: a model built on meta and loaded from a safetensors checkpoint, ``serve_from_checkpoint=True``
   against the copy into the swap folder, alternating: setup seconds (offload_parameters) and bytes written, then
   ``generate(20)`` time; outputs checked equal to the in-memory model's.

    python benchmarks/hf_llama_stream.py [--folder DIR] [--rounds N] \
        [--part training|inference|both|budget|train-budget|serve] [--mode fused|grads] [--json PATH]

``--json PATH`` (parts training, inference, both) also writes the ratios for ``benchmarks/plot.py``.

The 2 cores and the disk are shared: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

warnings.filterwarnings("ignore")
SEQ, BATCH, STEPS = 32, 2, 3


FULL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
)  # --tiny: a smoke run (tests/test_benchmarks.py)
SIZE = dict(FULL)


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZE, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def train_child(variant: str, folder: str) -> None:
    """One variant's training steps; prints JSON: seconds of each step after the first, peak RSS bytes."""
    from deepoffload import TrainOptions
    from deepoffload.swap.params import offload_parameters

    model = build().train()
    ids = torch.randint(0, SIZE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if variant == "memory":
        optimizer = adam(model.parameters())
        step = lambda: (optimizer.step(), optimizer.zero_grad())  # noqa: E731
    else:
        offload = offload_parameters(model, folder, train=TrainOptions(optimizer=adam))
        step = lambda: (offload.step(), offload.zero_grad())  # noqa: E731
    peak, stop = [rss_bytes()], threading.Event()

    def sample() -> None:
        while not stop.wait(0.001):
            peak[0] = max(peak[0], rss_bytes())

    sampler = threading.Thread(target=sample)
    sampler.start()
    times = []
    try:
        for _ in range(STEPS):
            start = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            step()
            times.append(time.perf_counter() - start)
    finally:
        stop.set()
        sampler.join()
    print(json.dumps({"seconds": times[1:], "rss": peak[0]}))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def training(folder: str, rounds: int) -> list[dict]:
    results: dict[str, list] = {"memory": [], "streamed": []}
    for r in range(rounds):
        for variant in ("memory", "streamed") if r % 2 == 0 else ("streamed", "memory"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    variant,
                    "--folder",
                    folder,
                    *(["--tiny"] if SIZE == TINY else []),
                ],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"},
            ).stdout
            results[variant].append(json.loads(out.strip().splitlines()[-1]))
    step = {v: [statistics.median(x["seconds"]) for x in rs] for v, rs in results.items()}
    rss = {v: [x["rss"] / 2**20 for x in rs] for v, rs in results.items()}
    ratios = [s / m for s, m in zip(step["streamed"], step["memory"])]
    print(
        f"training step (batch {BATCH} x {SEQ} tokens, Adam): in memory {statistics.median(step['memory']):.3f} s, "
        f"streamed {statistics.median(step['streamed']):.3f} s, streamed/memory {statistics.median(ratios):.2f} "
        f"({' '.join(f'{x:.2f}' for x in ratios)})"
    )
    print(
        f"peak RSS while training: in memory {statistics.median(rss['memory']):.0f} MiB, streamed "
        f"{statistics.median(rss['streamed']):.0f} MiB, streamed/memory "
        f"{statistics.median(rss['streamed']) / statistics.median(rss['memory']):.2f}"
    )
    return [
        {
            "label": "training step streamed / in memory",
            "value": round(statistics.median(ratios), 3),
            "higher_is_better": False,
            "per_round": [round(x, 3) for x in ratios],
        },
        {
            "label": "peak RSS training streamed / in memory",
            "higher_is_better": False,
            "value": round(statistics.median(rss["streamed"]) / statistics.median(rss["memory"]), 3),
        },
    ]


def inference(folder: str, rounds: int) -> list[dict]:
    from accelerate import dispatch_model

    from deepoffload.swap.params import offload_parameters

    reference = build()
    ids = torch.randint(0, SIZE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected_logits = reference(ids).logits
        expected_tokens = reference.generate(ids, max_new_tokens=20, do_sample=False)
    ours = build()
    offload = offload_parameters(ours, f"{folder}/ours")
    theirs = build()
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
        **{f"model.layers.{i}": "disk" for i in range(8)},
    }
    theirs = dispatch_model(theirs, device_map=device_map, main_device="cpu", offload_dir=f"{folder}/accelerate")
    timings: dict[str, dict[str, list[float]]] = {
        "deepoffload": {"forward": [], "generate": []},
        "accelerate": {"forward": [], "generate": []},
    }
    models = {"deepoffload": ours, "accelerate": theirs}
    with torch.no_grad():
        for r in range(rounds):
            for name in ("deepoffload", "accelerate") if r % 2 == 0 else ("accelerate", "deepoffload"):
                model = models[name]
                start = time.perf_counter()
                logits = model(ids).logits
                timings[name]["forward"].append(time.perf_counter() - start)
                start = time.perf_counter()
                tokens = model.generate(ids, max_new_tokens=20, do_sample=False)
                timings[name]["generate"].append(time.perf_counter() - start)
                if not (torch.equal(logits, expected_logits) and torch.equal(tokens, expected_tokens)):
                    print(f"{name}: outputs differ from the in-memory model", file=sys.stderr)
    results = []
    for what in ("forward", "generate"):
        a, b = timings["deepoffload"][what], timings["accelerate"][what]
        ratios = [x / y for x, y in zip(a, b)]
        print(
            f"{what:8s} ({SEQ} tokens{', +20 new' if what == 'generate' else ''}): deepoffload "
            f"{statistics.median(a):.3f} s, accelerate disk offload {statistics.median(b):.3f} s, "
            f"deepoffload/accelerate {statistics.median(ratios):.2f} ({' '.join(f'{x:.2f}' for x in ratios)})"
        )
        label = "forward" if what == "forward" else "generate(20)"
        results.append(
            {
                "label": f"{label} / accelerate disk offload",
                "value": round(statistics.median(ratios), 3),
                "bound": 1.0,
                "higher_is_better": False,
                "per_round": [round(x, 3) for x in ratios],
            }
        )
    offload.close(restore=False)
    return results


def budget(folder: str, rounds: int) -> None:
    from accelerate import dispatch_model

    from deepoffload import StreamOptions
    from deepoffload.swap.params import offload_parameters

    reference = build()
    layer_bytes = sum(p.numel() * p.element_size() for p in reference.model.layers[0].parameters())
    ids = torch.randint(0, SIZE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=20, do_sample=False)
    for resident in (0, 4, 8):
        ours = build()
        offload = offload_parameters(
            ours, f"{folder}/ours-{resident}", stream=StreamOptions(max_resident_bytes=resident * layer_bytes)
        )
        device_map = {
            "model.embed_tokens": "cpu",
            "model.rotary_emb": "cpu",
            "model.norm": "cpu",
            "lm_head": "cpu",
            **{f"model.layers.{i}": "cpu" if i < resident else "disk" for i in range(8)},
        }
        theirs = dispatch_model(
            build(), device_map=device_map, main_device="cpu", offload_dir=f"{folder}/accelerate-{resident}"
        )
        models = {"deepoffload": ours, "accelerate": theirs}
        timings: dict[str, list[float]] = {"deepoffload": [], "accelerate": []}
        with torch.no_grad():
            for r in range(rounds):
                for name in ("deepoffload", "accelerate") if r % 2 == 0 else ("accelerate", "deepoffload"):
                    start = time.perf_counter()
                    tokens = models[name].generate(ids, max_new_tokens=20, do_sample=False)
                    timings[name].append(time.perf_counter() - start)
                    if not torch.equal(tokens, expected):
                        print(f"{name}: outputs differ from the in-memory model", file=sys.stderr)
        a, b = timings["deepoffload"], timings["accelerate"]
        ratios = [x / y for x, y in zip(a, b)]
        print(
            f"generate(20), {resident} of 8 layers resident ({resident * layer_bytes / 1e6:.0f} MB): deepoffload "
            f"{statistics.median(a):.3f} s, accelerate {statistics.median(b):.3f} s, deepoffload/accelerate "
            f"{statistics.median(ratios):.2f} ({' '.join(f'{x:.2f}' for x in ratios)})"
        )
        offload.close(restore=False)


def train_budget(folder: str, rounds: int, mode: str) -> None:
    from deepoffload import StreamOptions, TrainOptions
    from deepoffload.swap.params import offload_parameters

    ids = torch.randint(0, SIZE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    runs = {}
    for resident in (0, 4, 8):
        model = build().train()
        layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        offload = offload_parameters(
            model,
            f"{folder}/train-{resident}",
            train=TrainOptions(optimizer=adam, mode=mode),
            stream=StreamOptions(max_resident_bytes=resident * layer_bytes),
        )
        runs[resident] = (model, offload)
    times: dict[int, list[float]] = {k: [] for k in runs}
    losses: dict[int, list[float]] = {k: [] for k in runs}
    moved: dict[int, list[float]] = {k: [0, 0, 0, 0, 0.0] for k in runs}
    order = list(runs)
    for r in range(rounds + 1):  # round 0 warms up (first step allocates the optimizer state) and is not timed
        for resident in order[r % 3 :] + order[: r % 3]:
            model, offload = runs[resident]
            before = offload.stats
            start = time.perf_counter()
            loss = model(ids, labels=ids).loss
            loss.backward()
            offload.step()
            offload.zero_grad()
            elapsed = time.perf_counter() - start
            losses[resident].append(loss.item())
            if r:
                times[resident].append(elapsed)
                after = offload.stats
                for k, field in enumerate(
                    ("bytes_read", "bytes_written", "state_bytes_read", "state_bytes_written", "io_wait_seconds")
                ):
                    moved[resident][k] += getattr(after, field) - getattr(before, field)
    if not losses[0] == losses[4] == losses[8]:
        print("losses differ between budgets", losses, file=sys.stderr)
    for resident in runs:
        ratios = [x / y for x, y in zip(times[resident], times[0])]
        read, written, state_read, state_written = (m / rounds / 1e6 for m in moved[resident][:4])
        print(
            f"training step ({mode}), {resident} of 8 layers resident: {statistics.median(times[resident]):.3f} s, "
            f"/budget 0 {statistics.median(ratios):.2f} ({' '.join(f'{x:.2f}' for x in ratios)}); per step: "
            f"parameters and gradients read {read:.0f} MB, written {written:.0f} MB, waited on "
            f"{moved[resident][4] / rounds:.3f} s; optimizer state read {state_read:.0f} MB, written "
            f"{state_written:.0f} MB"
        )
    for _, offload in runs.values():
        offload.close(restore=False)


def serve(folder: str, rounds: int) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from deepoffload import LoadOptions
    from deepoffload.swap.params import offload_parameters

    reference = build()
    checkpoint = f"{folder}/model.safetensors"
    save_file(reference.state_dict(), checkpoint)
    ids = torch.randint(0, SIZE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=20, do_sample=False)
    timings: dict[str, dict[str, list[float]]] = {v: {"setup": [], "generate": []} for v in ("served", "copied")}
    written: dict[str, int] = {}
    for r in range(rounds):
        for variant in ("served", "copied") if r % 2 == 0 else ("copied", "served"):
            with torch.device("meta"):
                model = LlamaForCausalLM(reference.config).eval()
            start = time.perf_counter()
            offload = offload_parameters(
                model,
                f"{folder}/{variant}",
                load=LoadOptions(
                    checkpoint=checkpoint, init=model._init_weights, serve_from_checkpoint=variant == "served"
                ),
            )
            timings[variant]["setup"].append(time.perf_counter() - start)
            written[variant] = offload.stats.bytes_written
            with torch.no_grad():
                start = time.perf_counter()
                tokens = model.generate(ids, max_new_tokens=20, do_sample=False)
                timings[variant]["generate"].append(time.perf_counter() - start)
            if not torch.equal(tokens, expected):
                print(f"{variant}: outputs differ from the in-memory model", file=sys.stderr)
            offload.close(restore=False)
    for what in ("setup", "generate"):
        a, b = timings["served"][what], timings["copied"][what]
        ratios = [x / y for x, y in zip(a, b)]
        print(
            f"{what:8s}: served {statistics.median(a):.3f} s, copied {statistics.median(b):.3f} s, served/copied "
            f"{statistics.median(ratios):.2f} ({' '.join(f'{x:.2f}' for x in ratios)})"
        )
    print(f"bytes written to the swap folder at setup: served {written['served']}, copied {written['copied']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="where swap files go (default: a temp folder)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--part", choices=["training", "inference", "both", "budget", "train-budget", "serve"], default="both"
    )
    parser.add_argument("--mode", choices=["fused", "grads"], default="fused", help="train-budget's training mode")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden size 64 (a smoke run)")
    parser.add_argument("--child", choices=["memory", "streamed"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="--part training, inference or both: also write the ratios as JSON (benchmarks/plot.py)",
    )
    args = parser.parse_args()
    if args.json and args.part not in ("training", "inference", "both"):
        parser.error("--json is written by --part training, inference or both")
    if args.tiny:
        SIZE.update(TINY)
    folder = args.folder or tempfile.mkdtemp(prefix="hf-llama-stream-")
    os.makedirs(folder, exist_ok=True)  # the swap folders go under it, and deepoffload creates only their last part
    if args.child:
        train_child(args.child, folder)
        return
    results = []
    if args.part in ("training", "both"):
        results += training(folder, args.rounds)
    if args.part in ("inference", "both"):
        results += inference(folder, args.rounds)
    if args.json:
        write_json(
            args.json,
            "hf_llama_stream",
            "Tiny HF Llama streamed from storage (hidden 512, 8 layers)",
            results,
            unit="time / time of the other (lower is better)",
        )
    if args.part == "budget":
        budget(folder, args.rounds)
    if args.part == "train-budget":
        train_budget(folder, args.rounds, args.mode)
    if args.part == "serve":
        serve(folder, args.rounds)


if __name__ == "__main__":
    main()
