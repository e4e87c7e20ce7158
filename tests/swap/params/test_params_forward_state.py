"""A streamed block's recompute in backward runs under the state its forward ran under (``forward_state``):
autocast, RNG, kernel settings; so mixed-precision training is bit-identical to training in memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from deepoffload import TrainOptions
from deepoffload.swap.params import offload_parameters
from deepoffload.swap.params.autograd.forward_state import ForwardState, flags


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def train(model, step, steps=3, **autocast):
    losses = []
    for k in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(k))
        torch.manual_seed(50 + k)
        with torch.autocast("cpu", **autocast):
            loss = model(x).float().pow(2).mean()
        loss.backward()  # outside autocast, as users write it
        step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_bf16_autocast_trains_like_in_memory(scratch, mode):
    """The recompute ran outside autocast (float32 where the forward computed in bfloat16): gradients differed."""
    torch.manual_seed(0)
    ref = Net().train()
    model = copy.deepcopy(ref)
    opt = sgd(ref.parameters())
    seen = []
    model.layers[1][0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))

    def ref_step():
        opt.step()
        opt.zero_grad()

    expected = train(ref, ref_step, dtype=torch.bfloat16)
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=sgd)) as off:

        def off_step():
            off.step()
            off.zero_grad()

        assert train(model, off_step, dtype=torch.bfloat16) == expected
        assert set(seen) == {torch.bfloat16}  # forward and recompute alike
        state = off.state_dict()
    assert [n for n, t in ref.state_dict().items() if not torch.equal(t, state[n])] == []


def test_recompute_restores_kernel_settings_and_puts_back_the_callers(scratch):
    """A setting changed between forward and backward (here the default dtype, which ``torch.arange`` and factory
    calls inside a block follow) is the forward's during the recompute and the caller's again afterwards."""
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            seen.append((torch.get_default_dtype(), torch.is_autocast_enabled("cpu")))
            return self.lin(x)

    model = nn.Sequential(Probe(), Probe())
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=sgd)) as off:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(2, 4))
        torch.set_default_dtype(torch.float64)
        try:
            with torch.autocast("cpu", enabled=False):
                out.float().sum().backward()
            assert torch.get_default_dtype() == torch.float64
        finally:
            torch.set_default_dtype(torch.float32)
        off.step()
    assert seen == [(torch.float32, True)] * 4


def test_captured_settings_cover_autocast_and_kernel_flags():
    names = {name for name, _, _ in flags()}
    assert {
        "float32_matmul_precision",
        "deterministic_algorithms",
        "default_dtype",
        "mkldnn.enabled",
        "cudnn.deterministic",
    } <= names
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        state = ForwardState.capture([torch.zeros(1)])
    assert state.autocast_enabled == {"cpu": torch.bfloat16} and state.autocast_cache is False


def test_fp16_autocast_training_is_refused_at_the_first_forward(scratch, mode="fused"):
    """With a GradScaler, fused mode stepped each block with the scaled gradients inside backward (silently wrong
    before scaler.step() could raise); refused before any block steps, naming what to use. Grads mode trains under
    fp16 autocast exactly (tests/swap/params/test_params_fp16.py)."""
    torch.manual_seed(0)
    model = Net()
    before = copy.deepcopy(model.state_dict())
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=sgd)) as off:
        scaler = torch.amp.GradScaler("cpu")
        with (
            torch.autocast("cpu", dtype=torch.float16),
            pytest.raises(ValueError, match='float16.*GradScaler.*mode="grads".*bf'),
        ):
            scaler.scale(model(torch.randn(4, 16)).float().mean()).backward()
        with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():  # inference works
            model(torch.randn(4, 16))
        state = off.state_dict()
    assert all(torch.equal(before[n], state[n]) for n in before)
