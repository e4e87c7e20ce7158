"""A small decoder-only transformer language model and a synthetic corpus for the demo (no downloads).

The corpus is a fixed random Markov chain over the vocabulary: text with structure a model can learn (the loss
falls), generated from a seed, so two runs see the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSize:
    """The shape of a demo model and of its batches.

    Attributes:
        vocab: Tokens in the vocabulary.
        width: The embedding width.
        layers: Transformer blocks.
        heads: Attention heads per block.
        context: Tokens per sequence.
        batch: Sequences per batch.
    """

    vocab: int
    width: int
    layers: int
    heads: int
    context: int
    batch: int


SIZES = {
    "tiny": ModelSize(vocab=256, width=64, layers=2, heads=2, context=32, batch=4),
    "small": ModelSize(vocab=4096, width=256, layers=4, heads=4, context=64, batch=8),
    "medium": ModelSize(vocab=8192, width=512, layers=8, heads=8, context=128, batch=8),
    "large": ModelSize(vocab=16384, width=1024, layers=12, heads=16, context=128, batch=4),
}


class TinyLM(nn.Module):
    """A small decoder-only language model.

    Token and position embeddings, pre-norm transformer blocks (torch's own encoder layer with a causal mask), a final
    norm and an output projection.

    Args:
        size: The model's shape.
    """

    mask: torch.Tensor  # a buffer (register_buffer below), which nn.Module's __getattr__ types as Tensor | Module

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
        """Logits for the next token at each position.

        Args:
            tokens: (batch, context) int64 tokens.

        Returns:
            (batch, context, vocab) logits.
        """
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token cross-entropy over a batch.

        Args:
            tokens: (batch, context + 1) int64 tokens (as ``SyntheticText.batch()`` gives them).

        Returns:
            The mean loss (a scalar).
        """
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(size: str | ModelSize, seed: int = 0) -> TinyLM:
    """The model for a named size (``SIZES``), with weights drawn from ``seed``.

    Args:
        size: A name of ``SIZES``, or a ``ModelSize``.
        seed: The seed of the initial weights.

    Returns:
        The model.

    Raises:
        ValueError: When ``size`` names no size.
    """
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"model size {size!r}: expected one of {', '.join(SIZES)}")
        size = SIZES[size]
    torch.manual_seed(seed)
    return TinyLM(size)


class SyntheticText:
    """Batches of token sequences from a fixed random Markov chain (each token has 8 likely successors).

    Args:
        size: The shape of the batches (``vocab``, ``context``, ``batch``).
        seed: The seed of the chain and of the batches.
    """

    def __init__(self, size: ModelSize, seed: int = 0):
        self.size = size
        self.generator = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(size.vocab, (size.vocab, 8), generator=self.generator)

    def batch(self) -> torch.Tensor:
        """(batch, context + 1) int64 tokens."""
        s = self.size
        tokens = torch.empty(s.batch, s.context + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(s.vocab, (s.batch,), generator=self.generator)
        choices = torch.randint(8, (s.batch, s.context), generator=self.generator)
        for t in range(s.context):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return tokens
