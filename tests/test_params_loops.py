"""Streamed training in the loops people write around it: accelerate's gradient accumulation, resuming with
load_state_dict, and model changes after offloading."""

from __future__ import annotations

import copy

import pytest
import torch

from deepoffload.swap.params import offload_parameters
from test_params_forward_state import Net, sgd


def test_accelerate_accumulation_in_fused_mode_is_refused_before_any_block_steps(scratch):
    """Fused mode stepped every block inside the first micro-batch's backward; the second backward then raised,
    with the weights already changed by half a step."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = Net()
    before = copy.deepcopy(model.state_dict())
    with offload_parameters(model, str(scratch), optimizer=sgd) as off:
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
        model = accelerator.prepare(model)
        try:
            with accelerator.accumulate(model), pytest.raises(RuntimeError, match="accumulate.*mode=\"grads\""):
                accelerator.backward(model(torch.randn(4, 16)).mean())
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
        state = off.state_dict()
    assert all(torch.equal(before[n], state[n]) for n in before)
