"""Dtype moves after offloading (``model.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.double()``):
the stored blocks are rewritten block by block, equal to the model converted in memory (they were refused)."""

from __future__ import annotations

import copy

import pytest
import torch

from deepoffload import StreamOptions, TrainOptions
from deepoffload.swap.params import offload_parameters
from tests.swap.params.test_params_forward_state import Net, sgd

MOVES = {
    "to-bf16": lambda m: m.to(torch.bfloat16),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "double": lambda m: m.double(),
    "to-dtype-kw": lambda m: m.to(dtype=torch.float16),
}


@pytest.mark.parametrize("budget", [None, "half"])
@pytest.mark.parametrize("move", list(MOVES))
def test_dtype_move_after_offloading_equals_converting_in_memory(scratch, move, budget):
    torch.manual_seed(0)
    ref = Net().eval()
    model = copy.deepcopy(ref)
    size = sum(p.numel() * p.element_size() for p in ref.layers.parameters())
    x = torch.randn(4, 16)
    with offload_parameters(
        model, str(scratch), stream=StreamOptions(max_resident_bytes=size // 2 if budget else None)
    ) as off:
        assert MOVES[move](model) is model
        MOVES[move](ref)
        state = off.state_dict()
        assert {n: t.dtype for n, t in state.items()} == {n: t.dtype for n, t in ref.state_dict().items()}
        assert [n for n, t in ref.state_dict().items() if not torch.equal(t, state[n])] == []
        with torch.no_grad():
            assert torch.equal(model(x.to(ref.head.weight.dtype)), ref(x.to(ref.head.weight.dtype)))
        back = model.float()
        assert back is model and all(t.dtype == torch.float32 for t in off.state_dict().values())


def test_training_after_a_dtype_move_equals_in_memory(scratch):
    torch.manual_seed(0)
    ref = Net().train()
    model = copy.deepcopy(ref)
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=sgd, mode="grads")) as off:
        model.double()
        ref.double()
        opt = sgd(ref.parameters())
        for k in range(2):
            x = torch.randn(4, 16, dtype=torch.float64)
            for m, step in ((model, off.step), (ref, opt.step)):
                torch.manual_seed(k)
                m(x).pow(2).mean().backward()
                step()
            off.zero_grad(), opt.zero_grad()
        state = off.state_dict()
    assert [n for n, t in ref.state_dict().items() if not torch.equal(t, state[n])] == []


def test_dtype_moves_of_compute_copies_and_device_moves_are_refused_before_anything_converts(scratch):
    torch.manual_seed(0)
    model = Net()
    with offload_parameters(model, str(scratch), stream=StreamOptions(compute_dtype=torch.bfloat16)) as off:
        before = off.state_dict()
        with pytest.raises(ValueError, match="compute_dtype=.*before offload_parameters"):
            model.half()
        with pytest.raises(ValueError, match="device"):
            model.to("meta")
        after = off.state_dict()
        assert all(torch.equal(before[n], after[n]) and after[n].dtype == before[n].dtype for n in before)
        assert model.head.weight.dtype == torch.float32
