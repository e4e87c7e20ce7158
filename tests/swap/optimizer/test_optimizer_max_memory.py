"""``OffloadedOptimizer(..., max_memory=N)``: staging buffers sized to the limit, or MemoryError at once naming the
least limit that works."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from deepoffload.errors import MemoryBudgetError
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.memory import process_bytes
from deepoffload.swap.optimizer import OffloadedOptimizer
from deepoffload.swap.optimizer_budget import FORWARD_BYTES, MIN_BUFFERS, fit_buffers

MiB = 1 << 20


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 8))  # largest parameter: 2 MiB


def test_too_small_is_refused_before_anything_is_wrapped(scratch):
    net = model()
    inner = torch.optim.Adam(net.parameters(), lr=1e-3)
    with pytest.raises(MemoryBudgetError, match=r"the least that works is \d+ bytes .* staging buffers"):
        OffloadedOptimizer(inner, config=SwapConfig(folder=str(scratch)), max_memory="10MB")
    OffloadedOptimizer(inner, config=SwapConfig(folder=str(scratch))).close()  # not marked wrapped: wraps again


def test_the_limit_the_refusal_advises_works_after_the_process_grew(scratch):
    net = model()
    with pytest.raises(MemoryBudgetError) as refused:
        OffloadedOptimizer(
            torch.optim.Adam, net.parameters(), config=SwapConfig(folder=str(scratch)), max_memory="10MB"
        )
    least = int(re.search(r"the least that works is (\d+) bytes", str(refused.value)).group(1))
    advised = re.search(r"OffloadedOptimizer\(\.\.\., max_memory='(\d+MB)'\)", str(refused.value)).group(1)
    grown = torch.ones(4 << 20, dtype=torch.uint8)  # the process grows as it runs (4 MiB, touched)
    with pytest.raises(MemoryBudgetError):  # so the least of before no longer works
        OffloadedOptimizer(torch.optim.Adam, net.parameters(), config=SwapConfig(folder=str(scratch)), max_memory=least)
    opt = OffloadedOptimizer(
        torch.optim.Adam, net.parameters(), config=SwapConfig(folder=str(scratch)), max_memory=advised
    )
    net(torch.randn(4, 512)).sum().backward()
    opt.step()
    opt.close()
    del grown


def test_buffers_shrink_to_the_room_left_and_training_is_unchanged(scratch):
    net, reference = model(), model()
    process = process_bytes()
    grads = sum(p.numel() * 4 for p in net.parameters())
    limit = process + grads + 3 * (2 * MiB) + FORWARD_BYTES + 4 * 6 * MiB  # room for 4 buffers of 6 MiB
    fitted = fit_buffers(list(net.parameters()), limit, process, SwapConfig())
    assert fitted.buffer_count == 4 and MIN_BUFFERS <= fitted.buffer_count
    assert 4 * MiB < fitted.chunk_bytes <= 6 * MiB  # below the default 32 MiB, above the largest state
    opt = OffloadedOptimizer(
        torch.optim.Adam, net.parameters(), config=SwapConfig(folder=str(scratch)), max_memory=64 << 30, lr=1e-2
    )
    assert opt.config.buffer_count == 4 and opt.config.chunk_bytes == 32 << 20  # room for the defaults
    plain = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(4, 512, generator=torch.Generator().manual_seed(step))
        for m, o in ((net, opt), (reference, plain)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), reference.parameters()))
    opt.close()
