"""A LoRA training step over a Llama-shaped bf16 base served from its ``save_pretrained`` folder, interleaved A B A B:

1. ``served``: ``deepoffload.from_pretrained(folder, load=LoadOptions(serve_from_checkpoint=True))`` then
   ``peft.get_peft_model``: the base is read from the folder's own files block by block (forward, then again for the
   recomputation in backward), the adapters step in memory;
2. ``accelerate``: transformers' ``from_pretrained(folder, device_map=..., offload_folder=...)`` with every decoder
   layer on "disk" (accelerate's disk offload: a second copy of the base in ``offload_folder``), then
   ``get_peft_model`` and ``torch.optim.AdamW`` over the adapters;
3. ``memory``: the same PEFT step on transformers' in-memory ``from_pretrained`` (where the base fits);
4. ``raw read``: the bytes the served step needs (the decoder layers' bytes, twice), read from the checkpoint file
   with plain reads after dropping it from the page cache: the bound the served step is compared with.

Each step's loss is checked equal between ``served`` and ``memory`` (bit for bit). Prints each variant's median step
time and the ratios: served / accelerate (goal <= 0.5), raw read / served (goal >= 0.9), served / memory.

    python benchmarks/lora.py [--folder DIR] [--rounds N] [--steps N] [--layers N] [--hidden N] [--quick]

The machine's 2 cores and disk are shared: figures from a loaded machine are not to be published; read the ratios.
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

warnings.filterwarnings("ignore")
SEQ, BATCH = 64, 1
TARGETS = ["q_proj", "v_proj"]


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


def save_base(folder: str, hidden: int, layers: int) -> str:
    from transformers import LlamaForCausalLM

    path = os.path.join(folder, "base")
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        LlamaForCausalLM(config(hidden, layers)).to(torch.bfloat16).save_pretrained(path)
    return path


def lora(model):
    import peft

    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=TARGETS)).train()


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


def timed_steps(model, step, zero_grad, steps: int, base: str) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for k in range(steps):
        drop_cache(base)
        start = time.perf_counter()
        loss = model(**batch(k)).loss
        loss.backward()
        step()
        zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return times, losses


def served(base: str, swap: str, steps: int):
    import deepoffload

    model, off = deepoffload.from_pretrained(
        base,
        path=swap,
        train=deepoffload.TrainOptions(lambda ps: torch.optim.AdamW(ps, lr=1e-4)),
        load=deepoffload.LoadOptions(serve_from_checkpoint=True, dtype=torch.bfloat16),
    )
    model = lora(model)
    with off:
        return timed_steps(model, off.step, off.zero_grad, steps, base)


def in_memory(base: str, steps: int, offload_folder: str | None = None):
    from transformers import LlamaForCausalLM

    kwargs = {}
    if offload_folder is not None:  # every decoder layer on "disk", the rest in memory
        layers = LlamaForCausalLM.config_class.from_pretrained(base).num_hidden_layers
        device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        device_map.update({f"model.layers.{i}": "disk" for i in range(layers)})
        kwargs = {"device_map": device_map, "offload_folder": offload_folder}
    model = lora(LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16, **kwargs))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return timed_steps(model, optimizer.step, optimizer.zero_grad, steps, base)


def raw_read(base: str, layer_bytes: int) -> float:
    """Seconds to read ``layer_bytes`` twice from the checkpoint (plain reads, page cache dropped first)."""
    (shard,) = [os.path.join(base, f) for f in os.listdir(base) if f.endswith(".safetensors")]
    drop_cache(base)
    buffer = bytearray(16 << 20)
    start = time.perf_counter()
    for _ in range(2):
        with open(shard, "rb", buffering=0) as f:
            left = layer_bytes
            while left > 0:
                n = f.readinto(memoryview(buffer)[: min(left, len(buffer))])
                if not n:
                    f.seek(0)
                    continue
                left -= n
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, one round, one step")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.layers, args.hidden = 1, 1, 2, 64
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        base = save_base(folder, args.hidden, args.layers)
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            meta = LlamaForCausalLM(config(args.hidden, args.layers))
        layer_bytes = sum(p.numel() * 2 for p in meta.model.layers.parameters())
        times: dict[str, list[float]] = {"served": [], "accelerate": [], "memory": [], "raw read": []}
        for r in range(args.rounds):
            t, served_losses = served(base, os.path.join(folder, f"swap{r}"), args.steps)
            times["served"] += t
            try:
                t, _ = in_memory(base, args.steps, offload_folder=os.path.join(folder, f"offload{r}"))
                times["accelerate"] += t
            except Exception as e:  # noqa: BLE001  (reported, not hidden: accelerate's disk offload may refuse training)
                print(f"accelerate disk offload failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            t, memory_losses = in_memory(base, args.steps)
            times["memory"] += t
            if served_losses != memory_losses:
                print(f"losses differ: served {served_losses} memory {memory_losses}", file=sys.stderr)
                return 1
            times["raw read"].append(raw_read(base, layer_bytes))
    median = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"base: {args.layers} layers, hidden {args.hidden}, bf16, {2 * layer_bytes / 2**20:.0f} MiB read per step")
    for name, seconds in median.items():
        print(f"{name:>10}: {seconds * 1000:9.1f} ms (median of {len(times[name])})")
    if "accelerate" in median:
        print(f"served / accelerate: {median['served'] / median['accelerate']:.2f} (goal <= 0.5)")
    print(f"raw read / served: {median['raw read'] / median['served']:.2f} (goal >= 0.9)")
    print(f"served / memory: {median['served'] / median['memory']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
