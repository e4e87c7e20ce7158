"""``deepoffload plan`` names the blocks ``max_resident_bytes`` keeps and the bytes a token of ``generate`` reads; the
same blocks are the ones a streamed model pins, and a forward reads exactly the bytes predicted."""

from __future__ import annotations

import re

import torch
from torch import nn

from deepoffload import StreamOptions
from deepoffload.cli.main import main
from deepoffload.cli.plan import blocks_of, resident_blocks
from deepoffload.swap.params import offload_parameters


class Stack(nn.Module):
    def __init__(self, layers: int = 12):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128, bias=False) for _ in range(layers))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def test_the_blocks_plan_names_are_those_pinned_and_a_forward_reads_what_it_predicts(scratch):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Stack()
    save_file(model.state_dict(), str(scratch / "model.safetensors"))
    blocks, _ = blocks_of({k: v.nbytes for k, v in model.state_dict().items()})
    kept = int(3.5 * blocks["layers.0"])
    resident = resident_blocks(blocks, kept)
    # numbered parts compare as numbers: layers.10 and layers.11 come last, not after layers.1
    assert resident == ["layers.0", "layers.1", "layers.2"]
    assert resident_blocks(blocks, sum(blocks.values()))[-3:] == ["layers.9", "layers.10", "layers.11"]
    predicted = sum(n for p, n in blocks.items() if p not in resident)
    x = torch.randn(2, 128)
    with torch.no_grad():
        expected = model(x)
    stream = StreamOptions(max_resident_bytes=kept, prefetch=0)
    with offload_parameters(model, str(scratch / "swap"), stream=stream) as off, torch.no_grad():
        assert {off.blocks[i].prefix for i in off.pinned} == set(resident)
        for _ in range(2):
            before = off.stats.bytes_read
            assert torch.equal(model(x), expected)
            assert off.stats.bytes_read - before == predicted


def test_plan_prints_the_resident_blocks_and_the_bytes_read_per_token(scratch, capsys):
    from safetensors.torch import save_file

    save_file(Stack().state_dict(), str(scratch / "model.safetensors"))
    assert main(["plan", str(scratch / "model.safetensors"), "--max-memory", "64GB"]) == 0
    out = capsys.readouterr().out
    assert "per token (generate): 12 of 12 blocks resident (layers.0, layers.1, layers.2 ... layers.11)" in out
    assert re.search(r"read per token: 0\.0 MB \(0 blocks streamed", out), out
