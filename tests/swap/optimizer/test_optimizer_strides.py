"""The state ``OffloadedOptimizer`` gives back (``state_dict()``) has the strides it had in memory: Adam's moments
of a ``channels_last`` convolution weight and of a transposed parameter were returned contiguous (stored bytes are
in contiguous order)."""

from __future__ import annotations

import torch

from deepoffload import OffloadedOptimizer, SwapConfig


def params():
    torch.manual_seed(0)
    conv = torch.nn.Parameter(torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last))
    transposed = torch.nn.Parameter(torch.randn(6, 5).t())
    return [conv, transposed, torch.nn.Parameter(torch.randn(5))]


def train(ps, opt, steps=3):
    for k in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(k)).as_strided(p.shape, p.stride())
        opt.step()


def test_state_given_back_keeps_its_strides(scratch):
    reference = params()
    plain = torch.optim.Adam(reference, lr=0.1)
    train(reference, plain)
    ps = params()
    with OffloadedOptimizer(torch.optim.Adam, ps, SwapConfig(folder=str(scratch), pin=False), lr=0.1) as opt:
        train(ps, opt)
        got, want = opt.state_dict()["state"], plain.state_dict()["state"]
        assert want[0]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
        for i in want:
            for key in want[i]:
                assert torch.equal(got[i][key], want[i][key]), (i, key)
                assert got[i][key].stride() == want[i][key].stride(), (i, key)
        resumed = torch.optim.Adam(reference, lr=0.1)
        resumed.load_state_dict(opt.state_dict())  # loading it back into memory: the strides of memory
        assert resumed.state[reference[1]]["exp_avg_sq"].stride() == (1, 5)
    with OffloadedOptimizer(torch.optim.Adam, params(), SwapConfig(folder=str(scratch), pin=False), lr=0.1) as opt:
        opt.load_state_dict(plain.state_dict())  # state loaded from memory, then given back
        assert opt.state_dict()["state"][0]["exp_avg"].stride() == want[0]["exp_avg"].stride()
