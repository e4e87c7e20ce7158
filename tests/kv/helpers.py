"""Helpers of the StorageCache tests: a small llama built from its config (no download) and generate with a cache."""

from __future__ import annotations

import torch
import transformers
from transformers import DynamicCache

import deepoffload

FLUSH = 4096  # one page: every cache here writes to its files after a few tokens


def llama(layers: int = 3, head_dim: int = 16, kv_heads: int = 2, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A small llama, eval mode, fixed seed."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        pad_token_id=0,
        eos_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


def prompt(batch: int = 2, tokens: int = 20, seed: int = 0) -> torch.Tensor:
    """Random token ids ``[batch, tokens]`` (no pad or eos: ids >= 1)."""
    return torch.randint(1, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def generate(model, ids: torch.Tensor, cache, seed: int = 1, **kwargs) -> torch.Tensor:
    """``model.generate`` with ``cache``, the RNG seeded first (sampling)."""
    torch.manual_seed(seed)
    kwargs.setdefault("max_new_tokens", 10)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kwargs)


def dynamic_and_storage(model, ids, folder, cache_kwargs=None, **kwargs):
    """Tokens of ``generate`` with a DynamicCache, then with a StorageCache in ``folder``, and its stats.

    Returns:
        (tokens with DynamicCache, tokens with StorageCache, the StorageCache's stats before close).
    """
    reference = generate(model, ids, DynamicCache(config=model.config), **kwargs)
    cache_kwargs = {"flush_bytes": FLUSH, **(cache_kwargs or {})}
    with deepoffload.StorageCache(folder, config=model.config, **cache_kwargs) as cache:
        tokens = generate(model, ids, cache, **kwargs)
        stats = cache.stats()
    return reference, tokens, stats
