"""``deepoffload demo --stream-layers`` end to end through the CLI's ``main``, on a tiny model (the demo's model size
is patched so the test stays fast): losses and parameters match the in-memory run, the summary reports the peak
resident bytes against the in-memory model state, and an unusable ``--path`` fails with exit code 1 and a hint."""

from __future__ import annotations

import re

import pytest

from deepoffload.cli.main import main
from deepoffload.demo import stream
from deepoffload.demo.model import ModelSize

TINY = ModelSize(vocab=64, width=32, layers=6, heads=2, context=16, batch=2)


@pytest.fixture
def tiny_model(monkeypatch):
    monkeypatch.setattr(stream, "STREAM_SIZE", TINY)


def megabytes(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in the output:\n{text}"
    return float(match.group(1))


def test_stream_demo_summary(tiny_model, scratch, capsys, monkeypatch):
    on_meta = []
    original = stream.offload_parameters

    def spy(model, *args, **kwargs):  # the streamed model reaches offload_parameters with no values in memory
        loading = kwargs.get("load") is not None and kwargs["load"].checkpoint is not None
        on_meta.append(all(p.is_meta for p in model.parameters()) and loading)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(stream, "offload_parameters", spy)
    code = main(["demo", "--stream-layers", "--steps", "3", "--path", str(scratch)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert on_meta == [True]
    assert (
        "6-block transformer built on the meta device and loaded block by block from a safetensors checkpoint, "
        "Adam, 3 steps" in out
    )
    assert re.search(
        r"losses matched exactly:\s+yes \(3 steps compared bit for bit, .*final parameters identical\)", out
    ), out
    in_memory = megabytes(r"in memory:\s+([\d.]+) MB of weights, gradients and Adam state", out)
    resident = megabytes(r"streamed, peak resident:\s+([\d.]+) MB", out)
    ratio = megabytes(r"the rest of the model\): ([\d.]+)x less", out)
    assert 0 < resident < in_memory
    # the three figures are printed rounded to 0.1: the ratio lies within what the rounded MB figures allow
    low, high = (in_memory - 0.05) / (resident + 0.05), (in_memory + 0.05) / max(resident - 0.05, 1e-9)
    assert low - 0.05 <= ratio <= high + 0.05, (ratio, in_memory, resident)
    assert megabytes(r"on storage:\s+([\d.]+) MB", out) > 0
    assert list(scratch.iterdir()) == []  # the run folders are removed at the end


def test_stream_demo_unusable_path(tiny_model, tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    code = main(["demo", "--stream-layers", "--steps", "1", "--path", str(not_a_folder)])
    out = capsys.readouterr().out
    assert code == 1
    assert "choose another folder with --path" in out
