"""The KV cache on storage: greedy decode at a long context with ``deepoffload.StorageCache`` (at most two layers of
keys and values in memory) against the raw read of the bytes each token needs, and against transformers' caches in
memory, interleaved per round in one process:

- ``storage``: ``StorageCache(folder, resident_layers=2)``: every token reads every layer's keys and values back;
- ``raw read``: the same files read whole through the async-IO handle (all at once, no compute): the disk's bound
  for the bytes a token needs;
- ``dynamic``: ``DynamicCache`` (all in memory);
- ``offloaded``: ``DynamicCache(offloading=True)`` (transformers' ``OffloadedCache``: on an accelerator only).

The cache is filled to ``--context`` tokens with random keys and values (what a token's decode costs does not depend
on them), in chunks, layer after layer as a chunked prefill does; then ``--steps`` tokens are decoded by a small
llama and timed. Ratios: storage over raw read (target <= 1.1) and storage over dynamic / offloaded, median of the
per-round ratios. The load average is printed with the figures (a shared machine disturbs them).

    python benchmarks/kv_cache.py [--folder DIR] [--context 32768] [--layers 4] [--heads 8] [--head-dim 128]
        [--steps 4] [--rounds 3] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402

FILL_CHUNK = 4096  # tokens per update while filling


def model_of(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.heads * args.head_dim,
        intermediate_size=args.heads * args.head_dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=args.head_dim,
        vocab_size=256,
        max_position_embeddings=args.context + args.steps + 8,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def fill(cache, args) -> None:
    """``args.context`` tokens of random keys and values in every layer, chunk by chunk."""
    import torch

    g = torch.Generator().manual_seed(2)
    for start in range(0, args.context, FILL_CHUNK):
        n = min(FILL_CHUNK, args.context - start)
        for layer in range(args.layers):
            k, v = (torch.randn(1, args.heads, n, args.head_dim, generator=g, dtype=torch.bfloat16) for _ in "kv")
            cache.update(k, v, layer)


def decode(model, cache, args) -> tuple[float, list[int]]:
    """Median seconds per token of ``args.steps`` greedy tokens, and the tokens."""
    import torch

    token, times, tokens = torch.tensor([[1]]), [], []
    with torch.no_grad():
        for _ in range(args.steps):
            t0 = time.perf_counter()
            logits = model(token, cache=cache, use_cache=True).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
            tokens.append(int(token))
    return statistics.median(times), tokens


def raw_read(folder: str) -> float:
    """Seconds to read every file of a StorageCache's run folder whole, all reads in flight at once."""
    from deepoffload import AsyncIOHandle
    from deepoffload.io.buffers import aligned_empty

    paths = [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.startswith("layer")]
    buffers = [aligned_empty(os.path.getsize(p), pin=False) for p in paths]
    with AsyncIOHandle() as handle:
        t0 = time.perf_counter()
        for request in [handle.read_async(b, p, 0) for b, p in zip(buffers, paths) if b.numel()]:
            request.wait()
        return time.perf_counter() - t0


def one_round(model, args, folder: str, accelerator: bool) -> dict[str, float]:
    from transformers import DynamicCache

    from deepoffload import StorageCache

    out: dict[str, float] = {}
    tokens = {}
    with StorageCache(folder, config=model.config, resident_layers=2) as cache:
        fill(cache, args)
        out["storage"], tokens["storage"] = decode(model, cache, args)
        out["raw read"] = raw_read(cache.folder)
    cache = DynamicCache(config=model.config)
    fill(cache, args)
    out["dynamic"], tokens["dynamic"] = decode(model, cache, args)
    del cache
    if accelerator:
        cache = DynamicCache(config=model.config, offloading=True)
        fill(cache, args)
        out["offloaded"], _ = decode(model, cache, args)
        del cache
    if tokens["storage"] != tokens["dynamic"]:
        raise SystemExit(f"kv_cache: StorageCache's tokens {tokens['storage']} differ from {tokens['dynamic']}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, one round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.context, args.layers, args.heads, args.head_dim, args.steps, args.rounds = 300, 2, 2, 16, 2, 1
    import torch

    accelerator = torch.cuda.is_available()  # the model runs on the CPU here; OffloadedCache needs CUDA streams
    model = model_of(args)
    kv = 2 * args.layers * args.heads * args.head_dim * args.context * 2
    load = [os.getloadavg()[0]]
    print(f"KV cache: {kv / 2**20:.0f} MiB at {args.context} tokens; load average {load[0]:.2f}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        for _ in range(args.rounds):
            runs.append(one_round(model, args, folder, accelerator))
    load.append(os.getloadavg()[0])
    for name in runs[0]:
        per = [r[name] for r in runs]
        print(f"{name:<10} {statistics.median(per) * 1e3:10.1f} ms per token   " + " ".join(f"{s:.4f}" for s in per))
    rows = [("storage / raw read of its bytes", "raw read", 1.1), ("storage / dynamic (memory)", "dynamic", None)]
    if accelerator:
        rows.append(("storage / offloaded (OffloadedCache)", "offloaded", None))
    else:
        print("offloaded: not measured (OffloadedCache needs an accelerator)")
    results = []
    for label, other, bound in rows:
        ratios = [r["storage"] / r[other] for r in runs]
        target = "" if bound is None else f" (target <= {bound})"
        print(f"{label}: {statistics.median(ratios):.3f}{target}   " + " ".join(f"{x:.2f}" for x in ratios))
        result = {"label": label, "value": statistics.median(ratios), "per_round": ratios, "higher_is_better": False}
        if bound is not None:
            result["bound"] = bound
        results.append(result)
    print(f"load average: {load[0]:.2f} at the start, {load[1]:.2f} at the end", flush=True)
    if args.json:
        title = (
            f"KV cache on storage: greedy decode at {args.context} tokens, {args.layers} layers x {args.heads} heads "
            f"x {args.head_dim} (bf16, {kv / 2**20:.0f} MiB), 2 layers resident, load {load[0]:.1f}-{load[1]:.1f}"
        )
        write_json(args.json, "kv_cache", title, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
