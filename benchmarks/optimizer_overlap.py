"""Whole training steps (forward, backward, AdamW step) with the optimizer state in memory, offloaded and stepped in
``step()``, and offloaded with ``step_in_backward()``; plus the step's IO alone: the offloaded optimizer's own
extents of its pack file (same file, offsets and request sizes) read into reused buffers and each written back as
soon as it is in, reads kept as far ahead as the step keeps them, so reads and writes share the disk as in the step.
Interleaved A B C D A B C D, medians and ratios printed, for a tiny Hugging Face Llama built from a config and for an
MLP (``--mlp-width 4096``: 1.07 GB of AdamW state).

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


def step_io(handle, opt, ahead: int) -> float:
    """Seconds to read every extent of ``opt``'s pack file (in file order) and write each back from its buffer as
    soon as it is in, ``ahead`` reads in flight beyond the one waited for, as the step's pipeline does without its
    compute. Buffers are reused and already faulted in, as the step's pooled ones are."""
    from deepoffload.io.buffers import aligned_empty

    extents = sorted({id(e): e for e in opt.swapper._extents.values()}.values(), key=lambda e: e.offset)
    largest = max(e.nbytes for e in extents)
    free = [aligned_empty(largest) for _ in range(ahead + 2)]
    for b in free:
        b.fill_(0)
    path = opt.swapper.pack.path
    reads, writes = [], []  # (request, buffer)
    start = time.perf_counter()
    for k, extent in enumerate(extents):
        while len(reads) <= ahead and k + len(reads) < len(extents):
            if not free:
                request, buffer = writes.pop(0)
                request.wait()
                free.append(buffer)
            e, buffer = extents[k + len(reads)], free.pop()
            reads.append((handle.read_async(buffer[:e.nbytes], path, e.offset), buffer))
        request, buffer = reads.pop(0)
        request.wait()
        writes.append((handle.write_async(buffer[:extent.nbytes], path, extent.offset, truncate=False), buffer))
        while writes and writes[0][0].done():
            request, buffer = writes.pop(0)
            request.wait()
            free.append(buffer)
    for request, _ in writes:
        request.wait()
    return time.perf_counter() - start


def compare(name: str, build, rounds: int, folder: str) -> None:
    import torch

    from deepoffload.io.handle import AsyncIOHandle
    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

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
            times["IO alone"].append(step_io(handle, runs["offloaded"][2], max(1, config.buffer_count - 2)))
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
