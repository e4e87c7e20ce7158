"""`deepoffload demo` on the tiny model: trains, prints the summary with real figures, losses match exactly, and
cleans up its swap files (or keeps them with --keep)."""

from __future__ import annotations

import json
import os
import re

from deepoffload.cli.main import main
from deepoffload.demo.model import build_model


def adam_state_bytes(size: str) -> int:
    params = list(build_model(size).parameters())
    return sum(8 * p.numel() + 4 for p in params)  # exp_avg + exp_avg_sq (fp32) + a 0-dim fp32 step


def test_demo_tiny_prints_the_summary(scratch, capsys):
    assert main(["demo", "--steps", "3", "--model-size", "tiny", "--path", str(scratch)]) == 0
    out = capsys.readouterr().out
    assert f"optimizer state on storage: {adam_state_bytes('tiny'):,} bytes" in out
    assert re.search(r"memory saved: +-?[\d.]+ MB", out)
    moved = re.search(r"IO: +([\d.]+) MB moved at ([\d.]+) GB/s \(1e9 bytes/s", out)
    # step 1 writes the state; steps 2 and 3 read and write it; each parameter's file ends on a 4 KiB page
    state, pages = adam_state_bytes("tiny"), len(list(build_model("tiny").parameters())) * 4096
    assert moved and 5 * state / 1e6 - 0.05 <= float(moved.group(1)) <= 5 * (state + pages) / 1e6 + 0.05
    assert re.search(r"step time: +overhead [+-][\d.]+%", out)
    assert "losses matched exactly:     yes" in out and "final parameters identical" in out
    assert [name for name in os.listdir(scratch) if name.startswith("deepoffload-")] == []


def test_demo_keep_and_config(scratch, capsys, tmp_path):
    config = tmp_path / "aio.json"
    config.write_text(json.dumps({"block_size": 262144, "queue_depth": 8, "engine": "posix"}))
    assert main(["demo", "--steps", "1", "--model-size", "tiny", "--optimizer", "sgd", "--path", str(scratch),
                 "--config", str(config), "--keep"]) == 0
    out = capsys.readouterr().out
    assert "engine posix" in out
    kept = [name for name in os.listdir(scratch) if name.startswith("deepoffload-rank0-")]
    assert len(kept) == 1 and os.listdir(scratch / kept[0])
    assert f"swap files kept in {scratch / kept[0]}" in out


def test_demo_bad_input(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"queue_depth": 0}))
    assert main(["demo", "--config", str(bad)]) == 2
    assert "queue_depth: expected a positive integer" in capsys.readouterr().out
    assert main(["demo", "--steps", "0"]) == 2
