"""Reading an OffloadedOptimizer's state between steps: the tensors are on storage, and ``opt.state[p][key]`` says
so and where to read them, instead of a bare ``KeyError``."""

from __future__ import annotations

import pytest
import torch

import deepoffload


def test_a_stored_state_tensor_is_a_keyerror_that_says_where_it_is(scratch):
    p = torch.nn.Parameter(torch.ones(1000))
    opt = deepoffload.OffloadedOptimizer(
        torch.optim.Adam, [p], lr=0.1, config=deepoffload.SwapConfig(folder=str(scratch), pin=False)
    )
    try:
        p.grad = torch.ones_like(p)
        opt.step()
        assert "exp_avg" not in opt.state[p]
        with pytest.raises(
            KeyError,
            match="'exp_avg': this tensor of the parameter's optimizer state is on storage "
            "between steps.*opt.state_dict",
        ):
            opt.state[p]["exp_avg"]
        with pytest.raises(KeyError, match="^'nonsense'$"):
            opt.state[p]["nonsense"]
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], torch.full((1000,), 0.1))
        opt.state[p].clear()  # reset by the user: no longer "on storage"
        with pytest.raises(KeyError, match="^'exp_avg'$"):
            opt.state[p]["exp_avg"]
    finally:
        opt.close()
