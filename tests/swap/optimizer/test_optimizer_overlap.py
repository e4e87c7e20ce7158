"""OffloadedOptimizer.step_in_backward: chunks step inside backward as their gradients become ready, bit-identical
to the plain optimizer (a small MLP with a parameter that sometimes gets no gradient, and a tiny Hugging Face
Llama); gradient accumulation and gradients changed after backward are refused."""

from __future__ import annotations

import pytest
import torch

from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer


@pytest.fixture
def config(scratch):
    return SwapConfig(folder=str(scratch), chunk_bytes=8192, buffer_count=4)  # many chunks per step


class MLP(torch.nn.Module):
    """Seven layers, and a side layer used only in even steps (its parameters get no gradient in odd steps)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(6)], torch.nn.Linear(24, 3))
        self.side = torch.nn.Linear(24, 3)

    def forward(self, x, step=0):
        out = self.layers(x)
        return out + self.side(x) if step % 2 == 0 else out


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP()


def train(model, optimizer, steps: int = 6, inputs: int = 24) -> list[float]:
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, inputs, generator=g)
        loss = model(x, step).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    ],
)
def test_bit_identical_to_the_plain_optimizer(config, make):
    reference = mlp()
    expected = train(reference, make(reference.parameters()))
    model = mlp()
    with OffloadedOptimizer(make, model.parameters(), config) as opt:
        opt.step_in_backward()
        assert train(model, opt) == expected
        assert opt.stored_bytes() > 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_parameters_step_inside_backward(config):
    model = mlp()
    with OffloadedOptimizer(torch.optim.Adam, model.parameters(), config, lr=0.01) as opt:
        opt.step_in_backward()
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(4, 24)).square().mean().backward()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the first step is a check"
        opt.step()
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(4, 24)).square().mean().backward()
        changed = sum(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert changed == len(before), "every chunk completed in backward and stepped there"
        opt.step()


def test_accumulation_and_changed_gradients_are_refused(config):
    model = mlp()
    opt = OffloadedOptimizer(torch.optim.Adam, model.parameters(), config, lr=0.01)
    opt.step_in_backward()
    model(torch.randn(4, 24)).sum().backward()
    with pytest.raises(RuntimeError, match="second backward"):
        model(torch.randn(4, 24)).sum().backward()
    opt.step_in_backward(False)
    opt.zero_grad()
    opt.step_in_backward()
    model(torch.randn(4, 24)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="changed between backward and step"):
        opt.step()
    opt.close()


def test_tiny_llama_bit_identical(config):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)

    def run(model, opt):
        losses = []
        for step in range(4):
            ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(step))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    reference = build()
    expected = run(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3))
    model = build()
    with OffloadedOptimizer(
        torch.optim.AdamW, model.parameters(), config.replace(chunk_bytes=64 << 10), lr=1e-3
    ) as opt:
        opt.step_in_backward()
        assert run(model, opt) == expected
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
