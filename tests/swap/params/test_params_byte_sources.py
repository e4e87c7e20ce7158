"""A block's byte source: swap files take writes, a checkpoint serves read-only, and every refusal of a write names the
source's reason (the served checks of store, residency, loading, dtype moves and refusals ask the source)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepoffload import StreamOptions
from deepoffload.swap.params import offload_parameters
from deepoffload.swap.params.blocks.residency import Block
from deepoffload.swap.params.storage.sources import CheckpointFiles, SwapFiles


def test_swap_files_take_writes_and_a_checkpoint_is_read_only():
    assert SwapFiles().writable and SwapFiles().read_only() is None
    source = CheckpointFiles("/models/x/model.safetensors")
    assert not source.writable and source.where == "/models/x/model.safetensors"
    assert source.read_only() == (
        "served read-only from the checkpoint /models/x/model.safetensors (serve_from_checkpoint=True)"
    )


def test_a_block_asks_its_source_whether_a_change_can_be_written():
    block = Block(0, "layer", nn.Linear(2, 2), None)
    assert isinstance(block.source, SwapFiles) and block.served is None and block.unwritable(["weight"]) == {}
    block.source = CheckpointFiles("ckpt.safetensors")
    assert block.served == "ckpt.safetensors"
    assert block.unwritable(["weight"]) == {
        "weight": "its block is served read-only from the checkpoint ckpt.safetensors (serve_from_checkpoint=True)"
    }


def test_offloaded_blocks_read_from_swap_files(scratch):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with offload_parameters(model, str(scratch)) as off:
        assert all(isinstance(b.source, SwapFiles) for b in off.blocks)
        with torch.no_grad():
            model(torch.randn(1, 4))


def test_a_read_only_source_refuses_the_write_back(scratch):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with offload_parameters(model, str(scratch), stream=StreamOptions(max_resident_bytes=1 << 20)) as off:
        block = off.blocks[0]
        block.source = CheckpointFiles("elsewhere.safetensors")  # as if served: the store must not write it
        with pytest.raises(RuntimeError, match="served read-only from the checkpoint elsewhere.safetensors"):
            off.store.write_back(block)
        block.source = SwapFiles()
