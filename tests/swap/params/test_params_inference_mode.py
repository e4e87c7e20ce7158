"""``torch.inference_mode()`` before, between and after training of a streamed model, with every budget and mode:
buffers made under inference mode (staging, compute copies) are reused by training, which may not write them."""

from __future__ import annotations

import copy

import pytest
import torch

from deepoffload import StreamOptions, TrainOptions
from deepoffload.swap.params import offload_parameters
from tests.swap.params.test_params_forward_state import Net, sgd


@pytest.mark.parametrize("compute_dtype", [None, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("budget", ["none", "half", "all"])
@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_inference_mode_before_between_and_after_training(scratch, mode, budget, compute_dtype):
    torch.manual_seed(0)
    ref = Net().train()
    model = copy.deepcopy(ref)
    size = sum(p.numel() * p.element_size() for p in ref.layers.parameters())
    budget = {"none": None, "half": size // 2, "all": 2 * size}[budget]
    opt = sgd(ref.parameters())
    x = torch.randn(4, 16)
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode=mode, optimizer=sgd),
        stream=StreamOptions(max_resident_bytes=budget, compute_dtype=compute_dtype),
    ) as off:
        for k in range(3):
            with torch.inference_mode():
                torch.manual_seed(k)
                got = model(x)
            torch.manual_seed(k)
            expected = ref(x) if compute_dtype is None else got  # (bf16 blocks: the in-memory model is fp32)
            assert torch.equal(got, expected)
            if k == 2:
                break
            for m, step in ((model, off.step), (ref, opt.step)):
                torch.manual_seed(10 + k)
                m(x).pow(2).mean().backward()
                step()
            off.zero_grad(), opt.zero_grad()
        state = off.state_dict()
    if compute_dtype is None:
        assert [n for n, t in ref.state_dict().items() if not torch.equal(t, state[n])] == []
