"""transformers model classes built from tiny configs (no downloads), saved with ``save_pretrained`` and loaded twice:
by transformers' own ``from_pretrained`` and by ``deepoffload.from_pretrained``; the two must hold the same state and
give the same forward output."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch

# sizes given to every config (a config keeps the names it does not use as plain attributes)
TINY: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "ffn_dim": 48,
    "num_layers": 2,
    "num_heads": 4,
    "d_ff": 48,
    "d_kv": 8,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# when a config refuses TINY (a size it derives itself, a check across sizes), fewer sizes are tried
CORE = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
ATTEMPTS: tuple[tuple[str, ...] | None, ...] = (None, (*CORE, "num_hidden_layers"), CORE, ("vocab_size",))
MAX_PARAMETERS = 5_000_000  # above this the generic sizes did not make the model tiny


class CannotBuild(Exception):
    """The class cannot be built tiny from ``TINY`` (the reason is the message)."""


def build(model_class: Any, config_class: Any, **sizes: Any) -> torch.nn.Module:
    """``model_class`` built with seed 0, in eval mode, from ``config_class`` with ``TINY``'s sizes (or fewer of them,
    see ``ATTEMPTS``: the first that builds a model of at most ``MAX_PARAMETERS``).

    Raises:
        CannotBuild: When no attempt builds the model that small (the reasons are the message).
    """
    reasons = []
    for names in ATTEMPTS:
        chosen = {k: v for k, v in TINY.items() if names is None or k in names}
        try:
            config = config_class(**{**chosen, **sizes})
            with torch.device("meta"):  # counted first: sub-models with their default sizes can be large
                count = sum(p.numel() for p in model_class._from_config(config, dtype=torch.float32).parameters())
        except Exception as e:  # noqa: BLE001 - any failure to build is a reason to try fewer sizes, stated
            reasons.append(f"{type(e).__name__}: {str(e)[:200]}")
            continue
        if count > MAX_PARAMETERS:
            reasons.append(f"{count} parameters (it has sizes TINY does not set)")
            continue
        torch.manual_seed(0)
        return model_class._from_config(config, dtype=torch.float32).eval()
    raise CannotBuild(f"{model_class.__name__} does not build from tiny sizes: " + "; ".join(dict.fromkeys(reasons)))


def forward(model: torch.nn.Module, needed: bool = False) -> Any:
    """The model's output for a fixed batch of token ids (its first tensor output).

    Args:
        model: The model.
        needed: Raise when the forward fails (else None: the model needs other inputs, such as pixels).
    """
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            out = model(input_ids=ids)
    except Exception:
        if needed:
            raise
        return None
    return out[0] if isinstance(out, (tuple, list)) or hasattr(out, "to_tuple") else out


def compare(model_class: Any, config_class: Any, folder: Path, **sizes: Any) -> tuple[list[str], bool]:
    """Save a tiny ``model_class`` to ``folder`` and load it both ways.

    Returns:
        The state names whose values differ (or that one side lacks), and whether a forward output was compared.
    """
    import transformers

    import deepoffload

    model = build(model_class, config_class, **sizes)
    with contextlib.redirect_stdout(io.StringIO()):
        model.save_pretrained(folder / "ckpt")
    reference = model_class.from_pretrained(folder / "ckpt", dtype=torch.float32).eval()
    assert isinstance(reference, transformers.PreTrainedModel)
    streamed, off = deepoffload.from_pretrained(
        folder / "ckpt", model_class, path=str(folder / "swap"), stream=deepoffload.StreamOptions(prefetch=0)
    )
    with off:
        expected = reference.state_dict()
        state = streamed.state_dict()
        differ = sorted(set(expected) ^ set(state))
        differ += [n for n in expected if n in state and not torch.equal(expected[n], state[n])]
        buffers = dict(reference.named_buffers())
        differ += [n for n, b in streamed.named_buffers() if n in buffers and not torch.equal(b, buffers[n])]
        ref = forward(reference)
        compared = ref is not None  # where transformers' model runs on token ids alone, the streamed one must too
        if compared and not torch.equal(forward(streamed, needed=True), ref):
            differ.append("<forward output>")
    return differ, compared
