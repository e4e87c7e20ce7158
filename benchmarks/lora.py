"""A LoRA training step over a Llama-shaped bf16 base kept in its ``save_pretrained`` folder, interleaved A B A B.

Each (variant, round) runs in its own process (so that each one's peak memory is its own), in rotating order:

1. ``served``: ``deepoffload.from_pretrained(folder, load=LoadOptions(serve_from_checkpoint=True),
   stream=StreamOptions(recompute=False))`` then ``peft.get_peft_model``: the base is read from the folder's own
   safetensors file block by block (in the forward, then again for the backward, which runs the graph each frozen
   block's forward kept instead of recomputing it; ``--recompute``: the default, recomputing), the adapters step in
   memory (their AdamW state on storage);
2. ``accelerate``: transformers' ``from_pretrained(folder, device_map=..., offload_folder=...)`` with every decoder
   layer on "disk" (accelerate's disk offload: at load it writes a second copy of the base into ``offload_folder``,
   then reads each layer from there in its hooks), then ``get_peft_model`` and ``torch.optim.AdamW`` over the
   adapters. Two things are needed for accelerate's side to train at all, both public APIs:

   - PEFT moves each new ``lora_A``/``lora_B`` to the device of its base layer's weight
     (``LoraLayer._move_adapter_to_device_of_base_layer`` in peft/tuners/tuners_utils.py), and under accelerate's
     disk offload that weight is on "meta" (its values are loaded only inside the hook's ``pre_forward``). The
     adapters end on "meta": the forward computes garbage (a NaN loss) and backward fails with "Function
     MmBackward0 returned an invalid gradient at index 1 - expected device meta but got cpu". The workaround:
     after ``get_peft_model``, ``lora_A.to_empty(device="cpu")`` / ``lora_B.to_empty(device="cpu")`` on every
     ``peft.tuners.lora.LoraLayer``, then ``peft.set_peft_model_state_dict`` with the adapters' initial values
     (here those in-memory PEFT makes from the same seed, so all three variants start from the same adapters);
   - ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``: without it,
     autograd keeps every layer's weights that the hooks loaded until backward, so the peak memory is the whole
     base; with it, one layer at a time, as deepoffload's recomputation (the equal-peak-memory comparison).
3. ``memory``: the same PEFT step on transformers' in-memory ``from_pretrained`` (where the base fits);
4. ``raw read``: the bytes the served step read (``off.stats.bytes_read`` per step), read from the base's
   safetensors file through deepoffload's async-IO op (8 MiB requests, 4 in flight, page cache dropped first): the
   time the served step cannot beat while it reads those bytes.

Before each timed step the page cache of the files that variant reads (the base's folder, accelerate's offload
folder) is dropped. Each step's loss is checked equal across the three variants (bit for bit). Prints the median step
time (the first step of each process left out when there are several) and the peak RSS during the steps of each
variant, and the ratios (medians of the per-round ratios):

- served / accelerate step time (goal <= 0.5), and served / accelerate peak RSS;
- raw read / served step time (goal >= 0.9): 1.0 means the served step takes exactly the time of reading its bytes
  from the drive, so the closer to 1 the less the step adds to its reads (meaningful where the step is IO-bound,
  i.e. the raw read takes longer than the in-memory step; both are printed), and max(raw read, in-memory step) /
  served (goal >= 0.9): the same against the larger of the two things the served step cannot beat, its reads and
  the in-memory step's compute (with ``--recompute`` the served step also recomputes each block's forward for its
  backward, which the in-memory step does not);
- served / memory step time.

    python benchmarks/lora.py [--folder DIR] [--rounds N] [--steps N] [--layers N] [--hidden N] [--seq N]
        [--recompute] [--json PATH] [--quick]

``--json PATH`` writes the ratios for ``benchmarks/plot.py``. The machine's cores and disk may be shared: read the
ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
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
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's deepoffload
from common import write_json  # noqa: E402

warnings.filterwarnings("ignore")
SEQ, BATCH = 128, 1  # SEQ: --seq
RECOMPUTE = False  # --recompute: the served step recomputes each block's forward in backward (the default there)
TARGETS = ["q_proj", "v_proj"]
VARIANTS = ("served", "accelerate", "memory")


def config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=SEQ,
        dtype="bfloat16",
    )


def lora(model):
    import peft

    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=TARGETS)).train()


def save_base(folder: str, hidden: int, layers: int) -> str:
    """The base (``save_pretrained``) and the adapters' initial values as in-memory PEFT makes them (init.pt)."""
    import peft
    from transformers import LlamaForCausalLM

    path = os.path.join(folder, "base")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config(hidden, layers)).to(torch.bfloat16)
    with contextlib.redirect_stdout(io.StringIO()):
        model.save_pretrained(path)
    init = {k: v.clone() for k, v in peft.get_peft_model_state_dict(lora(model)).items()}
    torch.save(init, os.path.join(folder, "init.pt"))
    return path


def batch(step: int) -> dict:
    ids = torch.randint(3, 1024, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def drop_cache(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_steps(model, step, zero_grad, steps: int, cold: str, read=None) -> dict:
    """``steps`` training steps, each after dropping ``cold`` from the page cache; RSS sampled every millisecond."""
    times, losses, reads = [], [], []
    peak, stop = [rss_bytes()], threading.Event()

    def sample() -> None:
        while not stop.wait(0.001):
            peak[0] = max(peak[0], rss_bytes())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for k in range(steps):
            drop_cache(cold)
            before = read() if read else 0
            start = time.perf_counter()
            loss = model(**batch(k)).loss
            loss.backward()
            step()
            zero_grad()
            times.append(time.perf_counter() - start)
            reads.append((read() if read else 0) - before)
            losses.append(loss.item())
    finally:
        stop.set()
        sampler.join()
    return {"seconds": times, "losses": losses, "peak": peak[0], "read": reads}


def served(folder: str, steps: int) -> dict:
    import deepoffload

    base = os.path.join(folder, "base")
    model, off = deepoffload.from_pretrained(
        base,
        path=tempfile.mkdtemp(dir=folder, prefix="swap"),
        train=deepoffload.TrainOptions(lambda ps: torch.optim.AdamW(ps, lr=1e-4)),
        load=deepoffload.LoadOptions(serve_from_checkpoint=True, dtype=torch.bfloat16),
        stream=deepoffload.StreamOptions(recompute=RECOMPUTE),
    )
    model = lora(model)
    with off:
        return timed_steps(model, off.step, off.zero_grad, steps, base, lambda: off.stats.bytes_read)


def in_memory(folder: str, steps: int, disk: bool) -> dict:
    import peft
    from transformers import LlamaForCausalLM

    base, kwargs, cold = os.path.join(folder, "base"), {}, os.path.join(folder, "base")
    if disk:  # every decoder layer on "disk", the rest in memory
        layers = LlamaForCausalLM.config_class.from_pretrained(base).num_hidden_layers
        device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        device_map.update({f"model.layers.{i}": "disk" for i in range(layers)})
        cold = tempfile.mkdtemp(dir=folder, prefix="offload")
        kwargs = {"device_map": device_map, "offload_folder": cold}
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16, **kwargs)
    if disk:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = lora(model)
    if disk:  # PEFT put the adapters on "meta", the device of accelerate's offloaded base weights: back to memory
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.lora_A.to_empty(device="cpu")
                module.lora_B.to_empty(device="cpu")
        peft.set_peft_model_state_dict(model, torch.load(os.path.join(folder, "init.pt")))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return timed_steps(model, optimizer.step, optimizer.zero_grad, steps, cold)


def raw_read(folder: str, nbytes: int) -> float:
    """Seconds the async-IO op takes to read ``nbytes`` of the base's safetensors file (8 MiB requests, 4 in
    flight, from the page cache dropped; the file is read from its start again when ``nbytes`` is larger)."""
    from deepoffload import AsyncIOHandle
    from deepoffload.io.buffers import aligned_empty

    base = os.path.join(folder, "base")
    (shard,) = [os.path.join(base, f) for f in os.listdir(base) if f.endswith(".safetensors")]
    size = os.path.getsize(shard) // 4096 * 4096
    chunk = 8 << 20
    buffers = [aligned_empty(chunk) for _ in range(4)]
    drop_cache(base)
    requests, done, pending = [], 0, []
    while done < nbytes:
        offset = done % size
        n = min(chunk, nbytes - done, size - offset)
        requests.append((offset, n))
        done += n
    with AsyncIOHandle() as handle:
        start = time.perf_counter()
        for i, (offset, n) in enumerate(requests):
            if len(pending) == len(buffers):
                pending.pop(0).wait()
            pending.append(handle.read_async(buffers[i % len(buffers)][:n], shard, offset))
        for request in pending:
            request.wait()
        return time.perf_counter() - start


def child(variant: str, folder: str, steps: int) -> None:
    out = served(folder, steps) if variant == "served" else in_memory(folder, steps, disk=variant == "accelerate")
    print("RESULT " + json.dumps(out))


def run_child(variant: str, folder: str, steps: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", variant, "--folder", folder, "--seq", str(SEQ)]
    command += ["--recompute"] if RECOMPUTE else []
    done = subprocess.run([*command, "--steps", str(steps)], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{variant} failed (exit {done.returncode}): {tail}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> int:
    global SEQ, RECOMPUTE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per step (batch 1): fewer make it IO-bound")
    parser.add_argument("--recompute", action="store_true", help="served: recompute in backward (the default)")
    parser.add_argument("--json", metavar="PATH", help="also write the ratios as JSON (benchmarks/plot.py)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, one round, one step")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    SEQ, RECOMPUTE = args.seq, args.recompute
    if args.child:
        child(args.child, args.folder, args.steps)
        return 0
    if args.quick:
        args.rounds, args.steps, args.layers, args.hidden = 1, 1, 2, 64
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        save_base(folder, args.hidden, args.layers)
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        raw: list[float] = []
        for r in range(args.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for variant in order:
                runs[variant].append(run_child(variant, folder, args.steps))
            losses = {v: runs[v][-1]["losses"] for v in VARIANTS}
            if len({tuple(x) for x in losses.values()}) != 1:
                print(f"losses differ: {losses}", file=sys.stderr)
                return 1
            raw.append(raw_read(folder, statistics.median(runs["served"][-1]["read"])))
    warm = 1 if args.steps > 1 else 0  # the first step of a process pays one-time costs: left out where others ran
    step = {v: [statistics.median(run["seconds"][warm:]) for run in runs[v]] for v in VARIANTS}
    peak = {v: [run["peak"] for run in runs[v]] for v in VARIANTS}
    read = statistics.median(x for run in runs["served"] for x in run["read"][warm:])
    print(
        f"base: {args.layers} layers, hidden {args.hidden}, bf16; served step reads {read / 2**20:.0f} MiB; "
        f"{args.rounds} rounds x {args.steps} steps, page cache dropped before each step"
    )
    for v in VARIANTS:
        print(f"{v:>10}: step {statistics.median(step[v]) * 1000:9.1f} ms, peak RSS {max(peak[v]) / 2**20:7.0f} MiB")
    print(f"{'raw read':>10}: {statistics.median(raw) * 1000:9.1f} ms")

    def ratio(a: list[float], b: list[float]) -> tuple[float, list[float]]:
        per_round = [x / y for x, y in zip(a, b)]
        return statistics.median(per_round), per_round

    bound = [max(a, b) for a, b in zip(raw, step["memory"])]
    rows = [
        ("served / accelerate disk offload, step time", step["served"], step["accelerate"], 0.5, False),
        ("served / accelerate disk offload, peak RSS", peak["served"], peak["accelerate"], None, False),
        ("raw read of the served step's bytes / served step", raw, step["served"], 0.9, True),
        ("max(raw read, in-memory step) / served step", bound, step["served"], 0.9, True),
        ("served / in-memory PEFT, step time", step["served"], step["memory"], None, False),
        ("served / in-memory PEFT, peak RSS", peak["served"], peak["memory"], None, False),
    ]
    results = []
    for label, a, b, bound, higher in rows:
        value, per_round = ratio(a, b)
        goal = f" (goal {'>=' if higher else '<='} {bound})" if bound is not None else ""
        print(f"{label}: {value:.2f}{goal}   per round: {' '.join(f'{x:.2f}' for x in per_round)}")
        result = {"label": label, "value": value, "higher_is_better": higher, "per_round": per_round}
        if bound is not None:
            result["bound"] = bound
        results.append(result)
    if args.json:
        write_json(
            args.json,
            "lora",
            f"LoRA step over a served bf16 Llama base ({args.layers} layers, hidden {args.hidden}), "
            "vs accelerate's disk offload, the raw read of its bytes and in-memory PEFT",
            results,
            unit="ratio",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
