"""``deepoffload plan``: the memory plan of a checkpoint's model under a limit, or the least limit that works."""

from __future__ import annotations

import torch

from deepoffload.cli.main import main
from deepoffload.cli.plan import blocks_of


def checkpoint(folder):
    from safetensors.torch import save_file

    state = {f"model.layers.{i}.{n}": torch.zeros(256, 256) for i in range(4) for n in ("q.weight", "k.weight")}
    state["model.embed.weight"] = torch.zeros(64, 256)
    save_file(state, str(folder / "model.safetensors"))
    return folder / "model.safetensors"


def test_blocks_are_numbered_prefixes():
    blocks, rest = blocks_of({"model.layers.0.a": 4, "model.layers.0.b": 4, "model.layers.1.a": 4, "head.w": 2})
    assert blocks == {"model.layers.0": 8, "model.layers.1": 4} and rest == 2


def test_plan_prints_the_parts_and_the_expected_peak(scratch, capsys):
    path = checkpoint(scratch)
    assert main(["plan", str(path), "--max-memory", "64GB", "--prefetch", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 blocks" in out and "chosen: prefetch 2" in out and "expected peak" in out
    assert main(["plan", str(path), "--max-memory", "1MB", "--train"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "the least that works is" in out


def test_plan_refuses_bad_input(scratch, capsys):
    assert main(["plan", str(scratch / "missing.safetensors"), "--max-memory", "1GB"]) == 1
    assert "no such checkpoint" in capsys.readouterr().err
    assert main(["plan", str(checkpoint(scratch)), "--max-memory", "lots"]) == 2
    assert "--max-memory" in capsys.readouterr().err
