"""Shared set-up of the LoRA-over-a-served-base tests: a tiny Llama folder, the same PEFT run in memory and streamed."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

import deepoffload
from deepoffload import LoadOptions, TrainOptions

TARGETS = ["q_proj", "v_proj"]
LR = 1e-2
STEPS = 3


def llama_config(hidden: int = 32, layers: int = 2, vocab: int = 64):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def save_base(folder: Path, hidden: int = 32, layers: int = 2) -> Path:
    """A tiny Llama saved with ``save_pretrained`` (random weights from seed 0)."""
    import transformers

    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        transformers.LlamaForCausalLM(llama_config(hidden, layers)).save_pretrained(folder)
    return folder


def lora_config(**changes):
    import peft

    return peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.1, **changes)


def adam(params):
    return torch.optim.AdamW(params, lr=LR)


def in_memory(folder: Path):
    """transformers' own ``from_pretrained`` and ``get_peft_model``: the reference."""
    import peft
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(1)
    return peft.get_peft_model(model, lora_config())


def served(folder: Path, swap: Path, mode: str = "fused", **load):
    """The same base from ``deepoffload.from_pretrained`` served from its folder, then ``get_peft_model``."""
    import peft

    model, off = deepoffload.from_pretrained(
        folder,
        path=swap,
        train=TrainOptions(adam, mode=mode),
        load=LoadOptions(serve_from_checkpoint=True, **load),
    )
    torch.manual_seed(1)
    return peft.get_peft_model(model, lora_config()), off


def batch(k: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(10 + k))
    return {"input_ids": ids, "labels": ids}


def plain_loop(model, step, zero_grad, steps: int = STEPS) -> list[float]:
    """``steps`` training steps (dropout on: its RNG seeded per step)."""
    model.train()
    losses = []
    for k in range(steps):
        torch.manual_seed(100 + k)
        loss = model(**batch(k)).loss
        loss.backward()
        step()
        zero_grad()
        losses.append(loss.item())
    return losses


def adapters(model) -> dict[str, torch.Tensor]:
    """The adapter's values by name (those ``save_pretrained`` writes)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def assert_adapters_equal(model, reference, count: int = 8) -> None:
    """The ``count`` adapter tensors of ``model`` and ``reference`` have the same names and are equal bit for bit."""
    got, want = adapters(model), adapters(reference)
    assert sorted(got) == sorted(want) and len(got) == count
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder``."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
