"""The per-block residency state machine: every allowed move is in TRANSITIONS, and any other raises at once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepoffload import StreamOptions, TrainOptions
from deepoffload.swap.params import Residency, ResidencyError, offload_parameters
from deepoffload.swap.params.blocks.residency import TRANSITIONS, Block


def test_only_listed_transitions_are_allowed():
    for start in Residency:
        for to in Residency:
            block = Block(0, "0", nn.Linear(2, 2), None)
            block.state = start
            if to in TRANSITIONS[start]:
                block.move(to)
                assert block.state is to
            else:
                with pytest.raises(ResidencyError, match=f"from {start.value} to {to.value}"):
                    block.move(to)
                assert block.state is start


def test_blocks_follow_the_machine_while_streaming(scratch):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    offload = offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)),
        stream=StreamOptions(prefetch=1),
    )
    try:
        assert [b.state for b in offload.blocks] == [Residency.ON_STORAGE] * 3
        block = offload.blocks[1]
        with pytest.raises(ResidencyError, match="from on storage to resident"):
            offload.store.materialize(block)  # nothing is being read: refused, not computed with a placeholder
        model(torch.randn(2, 8)).sum().backward()
        assert offload.blocks[0].state is Residency.WRITING  # the last to step; its write is in flight
        offload.step()
        assert all(b.state is Residency.ON_STORAGE for b in offload.blocks)
    finally:
        offload.close()
    assert all(b.state is Residency.RESTORED for b in offload.blocks)
