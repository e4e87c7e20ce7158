"""A Mixture-of-Experts model (Mixtral layout, top-2 of 8 experts, random weights) written by ``save_pretrained``,
``generate`` greedy from its folder, interleaved per round (the order rotating):

- ``experts``: ``deepoffload.from_pretrained`` as it is: a forward reads the attention, the router and the chosen
  experts only (an expert cache within ``--cache-mb``, the next layer's router applied early);
- ``whole``: the same, with expert reads turned off (``off.experts.close()``): every block read whole each token;
- ``accelerate``: accelerate's disk offload as transformers loads it: ``from_pretrained(folder, device_map=...,
  offload_folder=...)`` with every decoder layer on "disk" and the rest on the CPU, as deepoffload keeps it (if
  it cannot load the model, its exact error is printed and the variant is ``dispatch_model`` with the same map);
- ``raw``: the bound: the swap files read whole through the op (8 MiB requests, 4 in flight), O_DIRECT; each
  variant's bound is the tokens/s this raw read would give for its bytes per token.

Printed and written (``--json``): tokens/s of each with its raw-read bound, storage bytes read per generated token
(deepoffload's ``stats.bytes_read``; accelerate reads every layer's weights each token by construction: its bytes
are the layers' bytes, not measured), the expert cache's hits, misses and prefetch accuracy, and the ratios
experts/whole and experts/accelerate. Every variant's tokens are checked equal to the model's in memory.

    python benchmarks/moe.py [--folder DIR] [--rounds N] [--tokens N] [--cache-mb N] [--quick] [--json PATH]

The 2 cores and the disk are shared: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

warnings.filterwarnings("ignore")
FULL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
QUICK = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def build(size: dict):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(**size, num_key_value_heads=size["num_attention_heads"], num_local_experts=8)
    return MixtralForCausalLM(config).eval()


def accelerate_model(ckpt: str, size: dict, offload: str):
    """accelerate's disk offload of the folder: every decoder layer on "disk", the rest on the CPU."""
    from transformers import MixtralForCausalLM

    layers = range(size["num_hidden_layers"])
    device_map = {
        **dict.fromkeys(("model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"), "cpu"),
        **{f"model.layers.{i}": "disk" for i in layers},
    }
    try:
        return MixtralForCausalLM.from_pretrained(ckpt, device_map=device_map, offload_folder=offload).eval()
    except Exception as e:  # noqa: BLE001 - recorded, then the same map through dispatch_model
        print(f"accelerate: from_pretrained(device_map=..., offload_folder=...) failed: {e!r}")
        from accelerate import dispatch_model

        return dispatch_model(build(size), device_map=device_map, main_device="cpu", offload_dir=offload)


def raw_read(folder: str) -> tuple[int, float]:
    """The swap files under ``folder`` read whole through the op (8 MiB requests, 4 in flight): bytes and seconds."""
    from deepoffload import AsyncIOHandle
    from deepoffload.io.buffers import aligned_empty

    chunk = 8 << 20
    buffers = [aligned_empty(chunk) for _ in range(4)]
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names if f.endswith(".swp")]
    total, start = 0, time.perf_counter()
    with AsyncIOHandle() as handle:
        pending: list = []
        i = 0
        for path in files:
            size = os.path.getsize(path)
            for offset in range(0, size, chunk):
                if len(pending) == len(buffers):
                    pending.pop(0).wait()
                n = min(chunk, size - offset)
                pending.append(handle.read_async(buffers[i % len(buffers)][: -(-n // 4096) * 4096], path, offset))
                total, i = total + n, i + 1
        for request in pending:
            request.wait()
    return total, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24, help="tokens generated per run")
    parser.add_argument("--cache-mb", type=float, default=0, help="expert cache (max_resident_bytes), MB")
    parser.add_argument("--quick", action="store_true", help="a smoke run at a tiny size (tests/test_benchmarks.py)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import deepoffload

    size = QUICK if args.quick else FULL
    folder = args.folder or tempfile.mkdtemp(prefix="moe-bench-")
    reference = build(size)
    with contextlib.redirect_stdout(io.StringIO()):
        reference.save_pretrained(f"{folder}/ckpt")
    ids = torch.randint(3, size["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=args.tokens, do_sample=False)
    cache = int(args.cache_mb * 1e6) or None
    stream = deepoffload.StreamOptions(max_resident_bytes=cache)
    ours = {}
    for name in ("experts", "whole"):
        model, off = deepoffload.from_pretrained(f"{folder}/ckpt", path=f"{folder}/{name}", stream=stream)
        if name == "whole":
            off.experts.close()
        ours[name] = (model, off)
    theirs = accelerate_model(f"{folder}/ckpt", size, f"{folder}/accelerate")
    layer_bytes = sum(p.numel() * p.element_size() for p in reference.model.layers.parameters())
    seconds: dict[str, list[float]] = {"experts": [], "whole": [], "accelerate": []}
    raw_rate: list[float] = []
    read: dict[str, list[float]] = {"experts": [], "whole": []}
    order = list(seconds)
    with torch.no_grad():
        for r in range(args.rounds):
            for name in order[r % 3 :] + order[: r % 3]:
                model = ours[name][0] if name in ours else theirs
                before = ours[name][1].stats.bytes_read if name in ours else 0
                start = time.perf_counter()
                out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
                seconds[name].append(time.perf_counter() - start)
                if not torch.equal(out, expected):
                    print(f"moe: {name} generated other tokens than the model in memory", file=sys.stderr)
                    return 1
                if name in ours:
                    read[name].append((ours[name][1].stats.bytes_read - before) / args.tokens)
            nbytes, took = raw_read(f"{folder}/experts")
            raw_rate.append(nbytes / took)
    rate = {k: args.tokens / statistics.median(v) for k, v in seconds.items()}
    per_token = {k: statistics.median(v) for k, v in read.items()}
    per_token["accelerate"] = float(layer_bytes)
    raw = statistics.median(raw_rate)
    bound = {k: raw / per_token[k] for k in rate}  # tokens/s if reading its bytes were all a token cost
    print(
        f"Mixtral-layout MoE, {size['num_hidden_layers']} layers, top-2 of 8, {args.tokens} tokens, "
        f"{args.rounds} rounds; raw read {raw / 1e6:.0f} MB/s"
    )
    print(f"{'variant':<12}{'tokens/s':>10}{'raw-read bound':>16}{'MB read/token':>16}")
    for name in seconds:
        note = " (every layer's bytes, by construction)" if name == "accelerate" else ""
        print(f"{name:<12}{rate[name]:>10.2f}{bound[name]:>16.2f}{per_token[name] / 1e6:>16.3f}{note}")
    stats = ours["experts"][1].experts.stats
    accuracy = stats.prefetch_accuracy
    print(
        f"expert cache: {stats.hits} hits, {stats.misses} misses, prefetch accuracy "
        f"{'n/a' if accuracy is None else f'{accuracy:.2f}'}, {stats.cached_bytes / 1e6:.2f} MB cached"
    )
    bytes_ratio = per_token["experts"] / per_token["whole"]
    print(f"bytes read experts/whole: {bytes_ratio:.3f} (goal <= 0.45)")
    print(
        f"tokens/s experts/whole: {rate['experts'] / rate['whole']:.2f} (goal > 1), experts/accelerate: "
        f"{rate['experts'] / rate['accelerate']:.2f} (goal >= 5)"
    )
    for _, off in ours.values():
        off.close(restore=False)
    if args.json:
        names = {"experts": "expert-only", "whole": "whole-block", "accelerate": "accelerate disk offload"}
        results = [
            {"label": f"{names[k]}: tokens/s (tick: raw read of its bytes)", "value": rate[k], "bound": bound[k]}
            for k in rate
        ]
        whole = per_token["whole"]
        results += [
            {
                "label": f"{names[k]}: bytes read per token / whole-block's ({per_token[k] / 1e6:.1f} MB)",
                "value": per_token[k] / whole,
                "higher_is_better": False,
                **({"bound": 0.45} if k == "experts" else {}),
            }
            for k in rate
        ]
        results += [
            {"label": "tokens/s expert-only / whole-block", "value": rate["experts"] / rate["whole"], "bound": 1.0},
            {"label": "tokens/s expert-only / accelerate", "value": rate["experts"] / rate["accelerate"], "bound": 5.0},
        ]
        title = "MoE generate: expert-only reads, whole blocks, accelerate"
        write_json(args.json, "moe", title, results, "as labelled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
