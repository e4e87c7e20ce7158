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
    # the tiny model's state is smaller than the staging buffers: say so, never a negative saving
    assert re.search(r"memory saved: +none: this model's state \([\d.]+ MB\) is smaller than the staging", out)
    assert not re.search(r"memory saved: +-", out)
    moved = re.search(r"IO: +([\d.]+) MB moved at ([\d.]+) GB/s \(1e9 bytes/s", out)
    # step 1 writes the state; steps 2 and 3 read and write it; each parameter's file ends on a 4 KiB page
    state, pages = adam_state_bytes("tiny"), len(list(build_model("tiny").parameters())) * 4096
    assert moved and 5 * state / 1e6 - 0.05 <= float(moved.group(1)) <= 5 * (state + pages) / 1e6 + 0.05
    assert re.search(
        r"step time: +overhead [+-][\d.]+% against in memory \(median of 2 per-step ratios, the two "
        r"runs interleaved, first step excluded; range [+-][\d.]+% to [+-][\d.]+%\)",
        out,
    )
    assert "losses matched exactly:     yes" in out and "final parameters identical" in out
    assert [name for name in os.listdir(scratch) if name.startswith("deepoffload-")] == []


def test_demo_keep_and_config(scratch, capsys, tmp_path):
    config = tmp_path / "aio.json"
    config.write_text(json.dumps({"block_size": 262144, "queue_depth": 8, "engine": "posix"}))
    assert (
        main(
            [
                "demo",
                "--steps",
                "1",
                "--model-size",
                "tiny",
                "--optimizer",
                "sgd",
                "--path",
                str(scratch),
                "--config",
                str(config),
                "--keep",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "engine posix" in out
    kept = [name for name in os.listdir(scratch) if name.startswith("deepoffload-rank0-")]
    assert len(kept) == 1 and os.listdir(scratch / kept[0])
    assert f"swap files kept in {scratch / kept[0]}" in out


def test_demo_bad_input(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"queue_depth": 0}))
    assert main(["demo", "--config", str(bad)]) == 2
    assert "queue_depth: must be a positive integer (requests in flight per thread), got 0" in capsys.readouterr().out
    assert main(["demo", "--steps", "0"]) == 2


def test_demo_one_step_says_what_it_measured(scratch, capsys):
    assert main(["demo", "--steps", "1", "--model-size", "tiny", "--path", str(scratch)]) == 0
    out = capsys.readouterr().out
    assert "after the first" not in out and "first step excluded" not in out
    assert "over the only step, which writes the state and reads nothing" in out
    assert "step time:                  not compared: the only step creates the optimizer state" in out


def test_demo_small_model_saves_memory(aio, scratch, capsys):
    assert main(["demo", "--steps", "4", "--model-size", "small", "--path", str(scratch)]) == 0
    out = capsys.readouterr().out
    saved = re.search(r"memory saved: +([\d.]+) MB \(state not in RAM, minus ([\d.]+) MB of staging buffers\)", out)
    assert saved and float(saved.group(1)) > 0
    assert "median of 3 per-step ratios" in out and "; range " in out


def test_demo_refuses_a_missing_folder_like_bench_and_tune(tmp_path, capsys):
    missing = tmp_path / "not" / "there"
    assert main(["demo", "--steps", "1", "--model-size", "tiny", "--path", str(missing)]) == 1
    assert f"{missing} is not an existing folder" in capsys.readouterr().out
    assert not (tmp_path / "not").exists()
    assert main(["bench", "--path", str(missing), "--size", "4K"]) == 1
    assert main(["tune", "--path", str(missing), "--size", "4K", "--budget", "5"]) == 1
    assert not (tmp_path / "not").exists()


def test_demo_builds_the_op_before_the_progress_bar(aio, scratch, capsys, monkeypatch):
    """The first-use build message goes on its own line, not into the progress bar's."""
    import tqdm

    from deepoffload.io import native as native_module

    events = []
    real_native, real_bar = native_module._native, tqdm.tqdm

    def native():
        events.append("op loaded")
        return real_native()

    class Bar(real_bar):
        def __init__(self, *args, **kwargs):
            events.append("bar")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(native_module, "_native", native)
    monkeypatch.setattr(tqdm, "tqdm", Bar)
    assert main(["demo", "--steps", "1", "--model-size", "tiny", "--path", str(scratch)]) == 0
    assert events and events[0] == "op loaded" and "bar" in events
