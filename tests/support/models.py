"""The tests' own small language model and token source (the demo's model may change without changing a test).

``build_model(size)`` gives a decoder-only transformer laid out as parameter offload's default block rule finds it:
``embed`` and ``position`` (token and position embeddings), ``blocks`` (torch's ``TransformerEncoder``, whose
``blocks.layers.{i}`` are the streamed blocks), ``norm`` and ``head``. ``SyntheticText(size, seed).batch()`` gives
``(batch, context + 1)`` int64 tokens from a seeded random Markov chain, the same for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSize:
    vocab: int
    width: int
    layers: int
    heads: int
    context: int
    batch: int


class TinyLM(nn.Module):
    """Embeddings, pre-norm causal transformer layers, a final norm and an output projection."""

    def __init__(self, size: ModelSize):
        super().__init__()
        self.size = size
        self.embed = nn.Embedding(size.vocab, size.width)
        self.position = nn.Parameter(torch.randn(size.context, size.width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            size.width, size.heads, 4 * size.width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, size.vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(size.context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy over ``(batch, n + 1)`` tokens."""
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(size: ModelSize, seed: int = 0) -> TinyLM:
    """A ``TinyLM`` whose weights are drawn from ``seed`` (two calls with one seed give equal models)."""
    torch.manual_seed(seed)
    return TinyLM(size)


class SyntheticText:
    """Seeded token batches: each token is followed by one of 8 fixed successors."""

    def __init__(self, size: ModelSize, seed: int = 0):
        self.size = size
        self.generator = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(size.vocab, (size.vocab, 8), generator=self.generator)

    def batch(self) -> torch.Tensor:
        s = self.size
        tokens = torch.empty(s.batch, s.context + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(s.vocab, (s.batch,), generator=self.generator)
        choices = torch.randint(8, (s.batch, s.context), generator=self.generator)
        for t in range(s.context):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return tokens
