"""Whole training steps (forward, backward, AdamW step) with the optimizer state in memory, offloaded and stepped in
``step()``, and offloaded with ``step_in_backward()``; plus the step's IO alone (the same bytes written and read
back through the handle, in chunks). Interleaved A B C A B C, medians and ratios printed, for a tiny Hugging Face
Llama built from a config and for an MLP.

    python benchmarks/optimizer_overlap.py [--rounds 3] [--folder DIR] [--mlp-width 1536] [--mlp-layers 8]

Target: step_in_backward <= 1.15 x max(in-memory step, IO alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def llama(hidden: int, layers: int, vocab: int):
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def mlp(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                  for _ in range(layers)])
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(0))
    return model, lambda m: m(x).square().mean()


def compare(name: str, build, rounds: int, folder: str) -> None:
    import torch

    from deepoffload.io.handle import AsyncIOHandle
    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer
    from optimizer_offload import io_only

    config = SwapConfig(folder=folder)
    runs = {}
    for variant in ("in memory", "offloaded", "step_in_backward"):
        model, loss_of = build()
        if variant == "in memory":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opt = OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=1e-4)
            if variant == "step_in_backward":
                opt.step_in_backward()
        runs[variant] = (model, loss_of, opt)

    def train_step(variant: str) -> float:
        model, loss_of, opt = runs[variant]
        start = time.perf_counter()
        loss_of(model).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    for variant in runs:  # first steps create the state
        train_step(variant)
    state = sum(t.numel() * t.element_size() for s in runs["in memory"][2].state.values() for t in s.values()
                if torch.is_tensor(t))
    times: dict[str, list[float]] = {v: [] for v in (*runs, "IO alone")}
    with AsyncIOHandle(config.aio) as handle:
        for _ in range(rounds):
            for variant in runs:
                times[variant].append(train_step(variant))
            times["IO alone"].append(io_only(handle, folder, state, config.chunk_bytes))
    same = all(torch.equal(a, b) for a, b in zip(runs["in memory"][0].parameters(),
                                                   runs["step_in_backward"][0].parameters()))
    for variant in ("offloaded", "step_in_backward"):
        runs[variant][2].close()
    m = {v: statistics.median(t) for v, t in times.items()}
    bound = max(m["in memory"], m["IO alone"])
    params = sum(p.numel() for p in runs["in memory"][0].parameters())
    print(f"{name}: {params / 1e6:.1f}M parameters, {state / 1e6:.0f} MB of AdamW state, {rounds} rounds")
    for variant, value in m.items():
        print(f"  {variant:17s} {value * 1e3:8.0f} ms")
    for variant in ("offloaded", "step_in_backward"):
        print(f"  {variant} / max(in memory, IO alone): {m[variant] / bound:.2f}x;  / in memory: "
              f"{m[variant] / m['in memory']:.2f}x")
    print(f"  step_in_backward parameters identical to in memory: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--llama-hidden", type=int, default=256)
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--llama-vocab", type=int, default=8000)
    parser.add_argument("--mlp-width", type=int, default=1536)
    parser.add_argument("--mlp-layers", type=int, default=8)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="overlap-", dir=args.folder or os.getcwd())
    try:
        compare("tiny Llama", lambda: llama(args.llama_hidden, args.llama_layers, args.llama_vocab), args.rounds,
                folder)
        compare("MLP", lambda: mlp(args.mlp_width, args.mlp_layers), args.rounds, folder)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
