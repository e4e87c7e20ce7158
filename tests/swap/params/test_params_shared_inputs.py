"""A tensor passed to several streamed blocks in one forward (T5's encoder output reaching every decoder block, its
position bias made by the first block and given to the others) gets its gradient summed in the order memory sums it
(``shared_inputs``): training is bit-identical to memory in fp32 and under bf16 autocast, with Adam, whose
normalised steps turn any rounding difference into a visible one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from deepoffload import TrainOptions
from deepoffload.swap.params import offload_parameters
from deepoffload.swap.params.autograd.shared_inputs import SharedInputs


class Cross(nn.Module):
    """A decoder block: attends to ``memory`` twice (keys and values), adds ``bias`` (made by the first block)."""

    def __init__(self, width: int, makes_bias: bool):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.bias = nn.Parameter(torch.randn(6, 6) * 0.1) if makes_bias else None

    def forward(self, x, memory, bias=None):
        if self.bias is not None:
            bias = self.bias * 1.0
        scores = self.q(x) @ self.k(memory).transpose(-1, -2) + bias
        return x + scores.softmax(-1) @ self.v(memory), bias


class EncoderDecoder(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.encoder = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2))
        self.decoder = nn.ModuleList(Cross(width, k == 0) for k in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, src, tgt):
        memory = src
        for layer in self.encoder:
            memory = layer(memory)
        x, bias = tgt, None
        for layer in self.decoder:
            x, bias = layer(x, memory, bias)
        return self.head(x)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def run(model, step, autocast: bool, steps: int = 4):
    losses = []
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        src, tgt = torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 16, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(src, tgt).float().pow(2).mean()
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["fused", "grads"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_shared_inputs_train_bit_identical_to_memory(scratch, mode, autocast):
    torch.manual_seed(0)
    ref = EncoderDecoder()
    model = copy.deepcopy(ref)
    opt = adam(ref.parameters())

    def ref_step():
        opt.step()
        opt.zero_grad()

    expected = run(ref, ref_step, autocast)
    blocks = [*model.encoder, *model.decoder]
    with offload_parameters(model, str(scratch), blocks=blocks, train=TrainOptions(mode=mode, optimizer=adam)) as off:

        def off_step():
            off.step()
            off.zero_grad()

        got = run(model, off_step, autocast)
        assert got == expected
        state = off.state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name


def test_a_new_forward_and_a_backward_forget_the_aliases():
    shared = SharedInputs()
    x = torch.randn(3, requires_grad=True)
    given, chained = shared.substitute(0, [x])
    assert given[0] is x and chained == [0]
    alias = x.detach().requires_grad_()
    shared.record([x], chained, (alias,))
    assert shared.substitute(1, [x])[0][0] is alias  # the next block of the same forward gets the alias
    assert shared.substitute(0, [x])[0][0] is x  # a lower index: a new forward
    shared.record([x], [0], (alias,))
    shared.clear()
    assert shared.substitute(1, [x])[0][0] is x
    shared.record([x], [0], (alias,))
    with torch.no_grad():
        x.mul_(2)  # changed in place after the block got it: the next block must get it, not the alias
    assert shared.substitute(2, [x])[0][0] is x
    frozen = torch.randn(3)
    assert shared.substitute(2, [frozen])[1] == []  # a tensor needing no gradient is not passed on
