"""The workloads of the memory harness, one per library entry point, run as ``python workloads.py ENTRY SHAPE
FOLDER`` (``prepare SHAPE FOLDER KIND...`` writes the checkpoints first, unconfined). Each prints one JSON line
with its result (outputs, losses, tokens, files), so a confined run can be compared with an unconfined one;
``sizes`` gives the model sizes the stated bounds are made of.

Shapes: ``large`` (blocks of one 16 MiB weight: above glibc's default mmap threshold, below its 32 MiB dynamic
ceiling), ``small`` (blocks of 64 tensors of 64 KiB: below the threshold). Everything runs with glibc's default
allocator settings (no ``MALLOC_*`` variables)."""

from __future__ import annotations

import json
import os
import re
import sys

import torch
from torch import nn

SHAPES = {  # width, tensors per block, blocks
    "large": (2048, 1, 8),
    "small": (128, 64, 8),
}
STEPS = 2
CHECKPOINTS = {
    "safetensors": "model.safetensors",
    "sharded": "sharded",
    "torch": "model.pt",
    "llama": "llama.safetensors",
    "llama_lora": "llama-lora",  # a save_pretrained-style folder (config.json, shards, index)
    "mixtral": "mixtral",  # a save_pretrained folder
}
# the checkpoint each entry point reads (None: none)
NEEDS = {
    "load_sharded": "sharded",
    "load_torch": "torch",
    "generate": "llama",
    "moe_generate": "mixtral",
    "checkpoint_save": None,
    "checkpoint_load": "torch",
    "optimizer_step": None,
    "train_activations": None,
    "generate_storage_cache": None,
    "lora_served": "llama_lora",
}
# the imports-only child that measures the process after the imports of each entry point (default "imports")
IMPORTS = {
    "generate": "imports_hf",
    "generate_storage_cache": "imports_hf",
    "moe_generate": "imports_hf",
    "train_fused": "imports_optim",
    "train_grads": "imports_optim",
    "train_budget": "imports_optim",
    "optimizer_step": "imports_optim",
    "train_max_memory": "imports_optim",
    "train_data_parallel": "imports_dist",
    "train_data_parallel_grads": "imports_dist",
    "lora_served": "imports_peft",
}
RESIDENT_BLOCKS = 3  # train_budget: max_resident_bytes of this many block spans
EXPERT_CACHE = 12 << 20  # moe_generate: max_resident_bytes, below a block: all of it holds experts (6 of 24)
ACTIVATIONS = (512, 32, 8192)  # train_activations: width, layers, rows; 64 saved tensors of 16 MiB (1 GiB)
ACTIVATION_ROWS = {"large": 8192, "small": 2048}  # train_activations' sequence length (rows) at each shape
KV_CACHE = (32, 4, 64, 4096, 512, 256 << 10)  # generate_storage_cache: layers, heads, head_dim, prompt, chunk, flush


class Tower(nn.Module):
    def __init__(self, width: int, pieces: int, depth: int):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(
            nn.Sequential(*(nn.Linear(width, width) for _ in range(pieces)), nn.Tanh()) for _ in range(depth)
        )
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=1024,
        max_position_embeddings=64,
    )


LORA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=200, vocab_size=1024, rank=8)


def lora_llama_config(layers: int | None = None):
    """lora_served's base: 200 blocks of 12.8 MiB (fp32), 2.7 GB in all, over 4 times its stated bound."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=LORA["hidden_size"],
        intermediate_size=LORA["intermediate_size"],
        num_hidden_layers=layers or LORA["num_hidden_layers"],
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=LORA["vocab_size"],
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],  # (what from_pretrained builds; save_pretrained of a model writes it)
    )


def lora_adapter_bytes(layers: int | None = None) -> int:
    """The LoRA adapters' bytes (rank 8 on q_proj and v_proj, fp32): A (r x h) and B (h x r) per module."""
    hidden, rank = LORA["hidden_size"], LORA["rank"]
    return (layers or LORA["num_hidden_layers"]) * 2 * 2 * rank * hidden * 4


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=1024,
        max_position_embeddings=64,
    )


def sizes(entry: str, shape: str, layers: int | None = None) -> dict:
    """The sizes the stated bound of ``entry`` is made of (bytes), from the model built on meta: every parameter,
    the largest block's staging span, the parameters and buffers outside blocks, the largest parameter."""
    from deepoffload.swap.params import find_blocks
    from deepoffload.swap.params.blocks.residency import span

    if entry in ("generate", "lora_served"):
        import accelerate
        from transformers import LlamaForCausalLM

        with accelerate.init_empty_weights():
            model = LlamaForCausalLM(llama_config() if entry == "generate" else lora_llama_config(layers))
    elif entry == "moe_generate":
        from transformers import MixtralForCausalLM

        with torch.device("meta"):
            model = MixtralForCausalLM(mixtral_config())
    else:
        with torch.device("meta"):
            model = Tower(*SHAPES[shape])
    blocks = [block for _, block in find_blocks(model)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    params = list(model.parameters())
    rest = [t for t in params + list(model.buffers()) if id(t) not in in_blocks]
    found = {
        "param_bytes": sum(t.numel() * t.element_size() for t in params),
        "block_span": max(span(b.parameters()) for b in blocks),
        "largest": max(t.numel() * t.element_size() for t in params),
        "rest_bytes": sum(t.numel() * t.element_size() for t in rest),
    }
    if entry == "train_budget":
        found["resident_bytes"] = RESIDENT_BLOCKS * found["block_span"]
    if entry in ("train_activations", "train_activations_plain"):
        found["activation_rows"] = ACTIVATION_ROWS[shape]
    if entry == "lora_served":
        found["adapter_bytes"] = lora_adapter_bytes(layers)
    if entry == "moe_generate":
        found["resident_bytes"] = EXPERT_CACHE
    return found


def activation_step(folder: str, offload: bool, rows: int = ACTIVATIONS[2]) -> float:
    """One step of a deep MLP whose saved activations (``ACTIVATIONS``, ``rows`` rows) are several times its stated
    bound, inside ``offload_activations`` (or plainly); returns a digest of the gradients."""
    import contextlib

    from deepoffload import offload_activations

    width, layers, _ = ACTIVATIONS
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)))
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(1))
    context = offload_activations(os.path.join(folder, "swap")) if offload else contextlib.nullcontext()
    with context:
        model(x).square().mean().backward()
    return digest(p.grad for p in model.parameters())


def kv_generate(folder: str, on_storage: bool) -> list[int]:
    """Greedy tokens after a ``KV_CACHE`` prompt prefilled in chunks, its keys and values in a ``StorageCache``
    (2 layers resident) or a ``DynamicCache``; the model (float32, random) is the user's."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from deepoffload import StorageCache

    layers, heads, head_dim, tokens, chunk, flush = KV_CACHE
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        intermediate_size=heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=256,
        max_position_embeddings=tokens + 8,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    if on_storage:
        cache = StorageCache(os.path.join(folder, "swap"), config=config, flush_bytes=flush)
    else:
        cache = DynamicCache(config=config)
    prompt = torch.randint(1, 256, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, prefill_chunk_size=chunk, cache=cache)
    getattr(cache, "close", lambda: None)()
    return out[0, tokens:].tolist()


def digest(tensors) -> float:
    return float(sum(t.double().sum() for t in tensors))


# -- preparing (unconfined) -------------------------------------------------------------------------------------
def prepare(shape: str, folder: str, kinds: list[str]) -> None:
    """Write the checkpoints of ``kinds`` (CHECKPOINTS' keys)."""
    from safetensors.torch import save_file

    from deepoffload.formats import save_sharded

    torch.manual_seed(0)
    state = Tower(*SHAPES[shape]).state_dict()
    for kind in kinds:
        path = os.path.join(folder, CHECKPOINTS[kind])
        if kind == "safetensors":
            save_file(state, path)
        elif kind == "sharded":
            save_sharded(state.items(), path, max_shard_bytes=64 << 20)
        elif kind == "torch":
            torch.save(state, path)
        elif kind == "llama_lora":
            prepare_lora_base(path)
        elif kind == "mixtral":
            from transformers import MixtralForCausalLM

            MixtralForCausalLM(mixtral_config()).save_pretrained(path)
        else:
            prepare_llama(path)


def prepare_llama(path: str) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    save_file(LlamaForCausalLM(llama_config()).state_dict(), path)


def prepare_lora_base(path: str) -> None:
    """lora_served's base as ``save_pretrained`` lays it out, written tensor by tensor (never whole in memory)."""
    import accelerate
    from transformers import LlamaForCausalLM

    from deepoffload.formats import save_sharded

    config = lora_llama_config()
    with accelerate.init_empty_weights():
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape in shapes.items():
            yield name, (torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02)

    config.save_pretrained(path)
    save_sharded(tensors(), path, max_shard_bytes=1 << 30)


def lora_served(folder: str) -> list:
    """LoRA (PEFT) over the base served from its folder: 2 steps; the losses and a digest of the adapters."""
    import peft

    import deepoffload
    from deepoffload import LoadOptions, TrainOptions

    model, off = deepoffload.from_pretrained(
        os.path.join(folder, CHECKPOINTS["llama_lora"]),
        path=os.path.join(folder, "swap"),
        train=TrainOptions(adam),
        load=LoadOptions(serve_from_checkpoint=True),
    )
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=LORA["rank"], target_modules=["q_proj", "v_proj"]))
    model.train()
    losses = []
    for step in range(STEPS):
        ids = torch.randint(3, LORA["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        off.step()
        off.zero_grad()
        losses.append(loss.item())
    adapters = digest(p.detach() for p in model.parameters() if p.requires_grad)
    swap = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(folder, "swap")) for f in fs)
    off.close(restore=False)
    return [losses, adapters, swap]


# -- the entry points -------------------------------------------------------------------------------------------
def offloaded(shape: str, folder: str, checkpoint: str = "model.safetensors", **options):
    from deepoffload import LoadOptions
    from deepoffload.swap.params import offload_parameters

    with torch.device("meta"):
        model = Tower(*SHAPES[shape])
    load = LoadOptions(checkpoint=os.path.join(folder, checkpoint))
    off = offload_parameters(model, os.path.join(folder, "swap"), load=load, **options)
    return model, off


def train(model, off) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        off.step()
        off.zero_grad()
        losses.append(loss.item())
    return losses


def one_rank_group(folder: str) -> None:
    """A gloo process group of this process alone: data_parallel= averages through it (buckets, all_reduce) as on
    many ranks, each of which holds the same memory."""
    import torch.distributed as dist

    store = os.path.join(folder, "rendezvous")
    if os.path.exists(store):
        os.unlink(store)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def run(entry: str, shape: str, folder: str) -> dict:
    out: dict = {}
    if entry == "sizes":
        return {name: sizes(name, shape) for name in sys.argv[4:]}
    if entry in ("imports", "imports_optim"):
        import deepoffload.formats  # noqa: F401
        import deepoffload.swap.params  # noqa: F401

        if entry == "imports_optim":  # a torch optimizer's first construction imports torch._dynamo: about 65 MiB
            torch.optim.Adam([nn.Parameter(torch.zeros(1))])
        return out
    if entry == "imports_dist":  # the same, with a one-rank gloo group (the data-parallel entries' process)
        torch.optim.Adam([nn.Parameter(torch.zeros(1))])
        one_rank_group(folder)
        return out
    if entry == "imports_peft":  # transformers and peft, and a torch optimizer constructed once (torch._dynamo)
        import peft  # noqa: F401
        import transformers  # noqa: F401
        from transformers import LlamaForCausalLM  # noqa: F401

        import deepoffload.swap.params  # noqa: F401

        torch.optim.Adam([nn.Parameter(torch.zeros(1))])
        return out
    if entry == "imports_hf":
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
        from transformers import LlamaForCausalLM  # noqa: F401

        import deepoffload.swap.params  # noqa: F401

        return out
    if entry in ("train_activations", "train_activations_plain"):
        out["result"] = activation_step(folder, entry == "train_activations", ACTIVATION_ROWS[shape])
    elif entry in ("generate_storage_cache", "generate_dynamic_cache"):
        out["result"] = kv_generate(folder, on_storage=entry == "generate_storage_cache")
    elif entry == "lora_served":
        out["result"] = lora_served(folder)
    elif entry.startswith("load_"):
        model, off = offloaded(shape, folder, CHECKPOINTS[NEEDS.get(entry, "safetensors")])
        with torch.no_grad():
            out["result"] = model(batch(0)[0]).sum().item()
        off.close(restore=False)
    elif entry.startswith("train_"):
        from deepoffload import StreamOptions, TrainOptions

        train_options = {
            "train_fused": TrainOptions(adam),
            "train_grads": TrainOptions(adam, mode="grads"),
            "train_data_parallel": TrainOptions(adam, data_parallel=True),
            "train_data_parallel_grads": TrainOptions(adam, mode="grads", data_parallel=True),
        }.get(entry, TrainOptions(adam))
        stream = StreamOptions(max_memory=os.environ.get("MAX_MEMORY")) if entry == "train_max_memory" else None
        if entry.startswith("train_data_parallel"):
            one_rank_group(folder)
        model, off = offloaded(shape, folder, train=train_options, stream=stream)
        if entry == "train_budget":
            off.set_max_resident_bytes(sizes(entry, shape)["resident_bytes"])
        out["result"] = train(model, off)
        off.close(restore=False)
    elif entry == "generate":
        import accelerate
        from transformers import LlamaForCausalLM

        from deepoffload import LoadOptions
        from deepoffload.swap.params import offload_parameters

        with accelerate.init_empty_weights():  # buffers (rotary inv_freq) in memory, parameters on meta
            model = LlamaForCausalLM(llama_config())
        off = offload_parameters(
            model, os.path.join(folder, "swap"), load=LoadOptions(checkpoint=os.path.join(folder, "llama.safetensors"))
        )
        prompt = torch.arange(1, 9).unsqueeze(0)
        out["result"] = model.generate(prompt, max_new_tokens=6, do_sample=False)[0].tolist()
        off.close(restore=False)
    elif entry == "moe_generate":  # experts read one by one, an expert cache within max_resident_bytes
        import deepoffload

        model, off = deepoffload.from_pretrained(
            os.path.join(folder, "mixtral"),
            path=os.path.join(folder, "swap"),
            stream=deepoffload.StreamOptions(max_resident_bytes=EXPERT_CACHE),
        )
        prompt = torch.arange(1, 9).unsqueeze(0)
        with torch.no_grad():
            out["result"] = model.generate(prompt, max_new_tokens=6, do_sample=False)[0].tolist()
        stats = off.experts.stats
        if not 0 < stats.cached_bytes <= EXPERT_CACHE or off.pinned:
            raise RuntimeError(f"the expert cache is not what moe_generate states: {stats}, pinned {off.pinned}")
        off.close(restore=False)
    elif entry in ("save", "state_dict"):
        model, off = offloaded(shape, folder)
        if entry == "save":
            off.save(os.path.join(folder, "saved"), max_shard_bytes=64 << 20)
            # (each save names its shards with a generation of its own: compared without it)
            out["result"] = sorted(
                re.sub(r"-[0-9a-f]{8}(?=\.safetensors$)", "", name)
                for name in os.listdir(os.path.join(folder, "saved"))
            )
        else:
            out["result"] = digest(off.state_dict().values())
        off.close(restore=False)
    elif entry in ("checkpoint_save", "checkpoint_load"):
        import deepoffload

        if entry == "checkpoint_save":
            torch.manual_seed(0)
            model = Tower(*SHAPES[shape])
            deepoffload.save(model.state_dict(), os.path.join(folder, "saved.pt"))
            out["result"] = os.path.getsize(os.path.join(folder, "saved.pt"))
        else:
            state = deepoffload.load(os.path.join(folder, "model.pt"))
            out["result"] = digest(state.values())
    elif entry == "optimizer_step":
        from deepoffload.swap.config import SwapConfig
        from deepoffload.swap.optimizer import OffloadedOptimizer

        torch.manual_seed(0)
        model = Tower(*SHAPES[shape])
        opt = OffloadedOptimizer(
            torch.optim.Adam, model.parameters(), config=SwapConfig(folder=os.path.join(folder, "swap")), lr=1e-3
        )
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out["result"] = losses
        opt.close()
    else:
        raise SystemExit(f"unknown entry point {entry!r}")
    return out


if __name__ == "__main__":
    entry, shape, folder = sys.argv[1:4]
    if entry == "prepare":
        prepare(shape, folder, sys.argv[4:])
    else:
        print(json.dumps(run(entry, shape, folder)))
