"""``StreamOptions(recompute=False)`` on a plain module: frozen blocks keep their forward's graph (gradients equal
the in-memory step's), and a forward that saves its parameters' memory in a form the backward cannot re-make from
the block read again is refused at that forward, naming the option that works (which is then tried)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepoffload import StreamOptions, TrainOptions, UnsupportedError, offload_parameters


class _SavesRawBytes(torch.autograd.Function):
    """``x @ w.T`` that saves ``w``'s bytes (a uint8 view: the parameter's memory, not a view of its dtype)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w.view(torch.uint8))
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        (raw,) = ctx.saved_tensors
        return grad @ raw.view(torch.float32), None


class _Frozen(nn.Module):
    def __init__(self, raw: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 4, requires_grad=False)
        self.raw = raw

    def forward(self, x):
        return torch.tanh(_SavesRawBytes.apply(x, self.weight) if self.raw else x @ self.weight.t())


def _model(raw: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), _Frozen(raw), _Frozen(raw), nn.Linear(8, 2))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _steps(model, step, zero_grad):
    torch.manual_seed(1)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        step()
        zero_grad()
        losses.append(loss.item())
    return losses


def test_frozen_blocks_keep_their_graph_and_train_as_in_memory(scratch):
    reference = _model(raw=False)
    optimizer = _sgd([p for p in reference.parameters() if p.requires_grad])
    expected = _steps(reference, optimizer.step, optimizer.zero_grad)
    model = _model(raw=False)
    stream = StreamOptions(recompute=False)
    with offload_parameters(
        model, str(scratch), blocks=[model[1], model[2]], train=TrainOptions(_sgd), stream=stream
    ) as off:
        assert _steps(model, off.step, off.zero_grad) == expected
    for got, want in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(got, want)


def test_a_saved_tensor_the_backward_cannot_remake_is_refused_at_the_forward(scratch):
    model = _model(raw=True)
    stream = StreamOptions(recompute=False)
    with offload_parameters(
        model, str(scratch), blocks=[model[1], model[2]], train=TrainOptions(_sgd), stream=stream
    ) as off:
        with pytest.raises(UnsupportedError, match=r"not a view of one parameter.*StreamOptions\(recompute=True\)"):
            model(torch.randn(4, 8))
        del off
    # the advice, followed: recomputing the forward in backward trains as in memory
    reference = _model(raw=True)
    optimizer = _sgd([p for p in reference.parameters() if p.requires_grad])
    expected = _steps(reference, optimizer.step, optimizer.zero_grad)
    model = _model(raw=True)
    with offload_parameters(
        model, str(scratch / "again"), blocks=[model[1], model[2]], train=TrainOptions(_sgd)
    ) as off:
        assert _steps(model, off.step, off.zero_grad) == expected
