"""The KV cache on storage: greedy decode at a long context with ``deepoffload.StorageCache`` (at most two layers of
keys and values in memory) against the raw read of the bytes each token needs, and against transformers' caches in
memory, interleaved per round in one process:

- ``storage``: ``StorageCache(folder, resident_layers=2)``: every token reads every layer's keys and values back;
- ``raw read``: the same files read whole through the async-IO handle (all at once, no compute), after each
  decoded token (interleaved): the disk's bound for the bytes a token needs;
- ``dynamic``: ``DynamicCache`` (all in memory; it concatenates each layer's keys and values with the new token's);
- ``compute``: the keys and values in memory, token-major with room to grow and handed to attention as views, as
  ``StorageCache`` hands them after its read (``in_place_cache``): the compute on them alone;
- ``offloaded``: ``DynamicCache(offloading=True)`` (transformers' ``OffloadedCache``: on an accelerator only).

The cache is filled to ``--context`` tokens with random keys and values (what a token's decode costs does not depend
on them), in chunks, layer after layer as a chunked prefill does; then ``--steps`` tokens are decoded by a small
llama and timed. A token's bound is the larger of the compute on its keys and values (``compute``) and the raw read
of the bytes that are not resident (``raw read``): the read of layer ``i + 1`` overlaps the compute of layer ``i``,
so neither can hide the other once it is the larger. Ratios (median of the per-round ratios): storage over that
bound and over the raw read (target <= 1.1 both), storage over dynamic / offloaded. The load average is printed with
the figures (a shared machine disturbs them).

The default size (32768 tokens, 4 layers of 8 heads x 128, float32: 1 GiB of keys and values, a llama-7B's
per-layer KV shape at a quarter of its heads) makes a token read 1 GiB, so reads matter on a CPU; float32 because a
CPU without bfloat16 instructions computes bfloat16 attention several times slower (the compute would hide the
reads).

    python benchmarks/kv_cache.py [--folder DIR] [--context 32768] [--layers 4] [--heads 8] [--head-dim 128]
        [--dtype float32] [--steps 4] [--rounds 3] [--quick] [--json PATH]
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
    return LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()


def fill(cache, args) -> None:
    """``args.context`` tokens of random keys and values in every layer, chunk by chunk."""
    import torch

    g = torch.Generator().manual_seed(2)
    dtype = getattr(torch, args.dtype)
    for start in range(0, args.context, FILL_CHUNK):
        n = min(FILL_CHUNK, args.context - start)
        for layer in range(args.layers):
            k, v = (torch.randn(1, args.heads, n, args.head_dim, generator=g).to(dtype) for _ in "kv")
            cache.update(k, v, layer, {"cache_position": torch.arange(start, start + n)})


def in_place_cache(config, layers: int):
    """A ``DynamicCache`` whose layers keep keys and values token-major in memory with room to grow and hand them out
    as views, as ``StorageCache`` does after its read: the compute on resident keys and values, without IO or a
    per-token copy of the stored tokens."""
    import torch
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class InPlaceLayer(DynamicLayer):
        rows: list

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.rows = [None, None]
            new_tokens = key_states.shape[-2]
            total = self.get_seq_length() + new_tokens
            out = []
            for i, new in enumerate((key_states, value_states)):
                b, h, _, d = new.shape
                rows = self.rows[i]
                if rows is None or rows.shape[0] < total:
                    grown = torch.empty(total + total // 8, b, h, d, dtype=new.dtype)
                    if rows is not None:
                        grown[: total - new_tokens].copy_(rows[: total - new_tokens])
                    rows = self.rows[i] = grown
                rows[total - new_tokens : total].copy_(new.permute(2, 0, 1, 3))
                out.append(rows[:total].permute(1, 2, 0, 3))
            self.keys, self.values = out
            return self.keys, self.values

    cache = DynamicCache(config=config)
    cache.layers = [InPlaceLayer() for _ in range(layers)]
    return cache


def decode(model, cache, args, between=None) -> tuple[float, list[int], float]:
    """Median seconds per token of ``args.steps`` greedy tokens, the tokens, and the median seconds of ``between``
    (called after each token, outside its time: the raw read, interleaved token by token)."""
    import torch

    token, times, tokens, others = torch.tensor([[1]]), [], [], []
    with torch.no_grad():
        for _ in range(args.steps):
            t0 = time.perf_counter()
            logits = model(token, cache=cache, use_cache=True).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
            tokens.append(int(token))
            if between is not None:
                others.append(between())
    return statistics.median(times), tokens, statistics.median(others) if others else 0.0


class RawRead:
    """Reads every file of a StorageCache's run folder whole, all reads in flight at once, into buffers made (and
    faulted in) once, through one handle: the disk's time for the bytes a token reads."""

    def __init__(self, folder: str):
        from deepoffload import AsyncIOHandle
        from deepoffload.io.buffers import aligned_empty

        self.paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.startswith("layer")]
        sizes = [os.path.getsize(p) for p in self.paths]
        self.buffers = [aligned_empty(max(size, 4096), pin=False, prefault=True)[:size] for size in sizes]
        self.handle = AsyncIOHandle()

    def __call__(self) -> float:
        t0 = time.perf_counter()
        requests = [self.handle.read_async(b, p, 0) for b, p in zip(self.buffers, self.paths) if b.numel()]
        for request in requests:
            request.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.handle.close()


def one_round(model, args, folder: str, accelerator: bool) -> dict[str, float]:
    from transformers import DynamicCache

    from deepoffload import StorageCache

    out: dict[str, float] = {}
    tokens = {}
    with StorageCache(folder, config=model.config, resident_layers=2) as cache:
        fill(cache, args)
        raw = RawRead(cache.folder)  # the files' sizes at the context: a decoded token adds under a page
        try:
            out["storage"], tokens["storage"], out["raw read"] = decode(model, cache, args, raw)
        finally:
            raw.close()
    cache = DynamicCache(config=model.config)
    fill(cache, args)
    out["dynamic"], tokens["dynamic"], _ = decode(model, cache, args)
    del cache
    cache = in_place_cache(model.config, args.layers)
    fill(cache, args)
    out["compute"], tokens["compute"], _ = decode(model, cache, args)
    del cache
    if accelerator:
        cache = DynamicCache(config=model.config, offloading=True)
        fill(cache, args)
        out["offloaded"], _, _ = decode(model, cache, args)
        del cache
    for other in ("dynamic", "compute"):
        if tokens["storage"] != tokens[other]:
            raise SystemExit(
                f"kv_cache: StorageCache's tokens {tokens['storage']} differ from {other}'s {tokens[other]}"
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
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
    kv = 2 * args.layers * args.heads * args.head_dim * args.context * getattr(torch, args.dtype).itemsize
    load = [os.getloadavg()[0]]
    print(f"KV cache: {kv / 2**20:.0f} MiB at {args.context} tokens; load average {load[0]:.2f}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        for _ in range(args.rounds):
            runs.append(one_round(model, args, folder, accelerator))
    load.append(os.getloadavg()[0])
    for r in runs:
        r["bound"] = max(r["raw read"], r["compute"])
    for name in runs[0]:
        per = [r[name] for r in runs]
        print(f"{name:<10} {statistics.median(per) * 1e3:10.1f} ms per token   " + " ".join(f"{s:.4f}" for s in per))
    rows = [
        ("storage / max(raw read, compute)", "bound", 1.1),
        ("storage / raw read of its bytes", "raw read", 1.1),
        ("storage / dynamic (memory)", "dynamic", None),
    ]
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
            f"x {args.head_dim} ({args.dtype}, {kv / 2**20:.0f} MiB), 2 layers resident, "
            f"load {load[0]:.1f}-{load[1]:.1f}"
        )
        write_json(args.json, "kv_cache", title, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
