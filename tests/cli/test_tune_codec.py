"""``deepoffload tune --codec``: ``codec="lossless"`` is chosen only where its decode outruns the drive's read
speed by enough to pay (the choice on given speeds), and the command writes the choice into a JSON that
``SwapConfig.from_json`` and ``AioConfig.from_json`` read back."""

from __future__ import annotations

import json

import pytest

from deepoffload import SwapConfig
from deepoffload.cli import tune
from deepoffload.cli.main import main
from deepoffload.config import AioConfig
from deepoffload.swap.codecs import choice

pytest.importorskip("zstandard")
GB = 1e9


@pytest.mark.parametrize(
    ("read", "decode", "ratio", "codec", "speedup"),
    [
        (0.5 * GB, 2.0 * GB, 0.68, "lossless", 1 / 0.68),  # slow disk: fewer bytes win, limited by the ratio
        (1.0 * GB, 1.2 * GB, 0.68, "lossless", 1.2),  # decode just ahead of the disk: limited by decode
        (1.0 * GB, 1.05 * GB, 0.68, "none", 1.05),  # a gain under the margin is not worth the CPU
        (3.0 * GB, 1.0 * GB, 0.68, "none", 1.0 / 3.0),  # fast NVMe: decode is the bottleneck, the codec a loss
        (0.5 * GB, 2.0 * GB, 0.95, "none", 1 / 0.95),  # data that does not compress
    ],
)
def test_choice_on_given_speeds(read, decode, ratio, codec, speedup):
    chosen = choice.choose(read, decode, ratio)
    assert chosen.codec == codec
    assert chosen.speedup == pytest.approx(speedup)
    assert f"codec {codec}" in chosen.reason
    if codec == "none" and decode < read:
        assert "decodes slower than the drive reads" in chosen.reason


def test_choice_refuses_nonsense_speeds():
    with pytest.raises(ValueError, match="positive"):
        choice.choose(0.0, 1.0, 0.7)


def test_measured_decode_speed_and_ratio():
    rate, ratio = choice.measure_decode(1 << 20, repeats=1)
    assert rate > 0 and 0.6 < ratio < 0.75


@pytest.mark.parametrize(("decode", "expected"), [(1e15, "lossless"), (1.0, "none")])
def test_tune_writes_the_choice_and_the_config_reads_it(scratch, tmp_path, monkeypatch, capsys, decode, expected):
    monkeypatch.setattr(choice, "measure_decode", lambda: (decode, 0.68))
    output = tmp_path / "aio.json"
    args = ["tune", "--path", str(scratch), "--budget", "3", "--size", "1M", "--output", str(output), "--codec"]
    assert main(args) == 0
    data = json.loads(output.read_text())
    assert data["codec"] == expected and tuple(data["aio"]) == AioConfig.keys()
    assert SwapConfig.from_json(output).codec == expected
    assert AioConfig.from_json(output).to_dict() == data["aio"]
    assert f"codec {expected}:" in capsys.readouterr().out


def test_tune_codec_needs_zstandard_before_searching(scratch, tmp_path, monkeypatch, capsys):
    real = tune.importlib.util.find_spec
    monkeypatch.setattr(tune.importlib.util, "find_spec", lambda n: None if n == "zstandard" else real(n))
    output = tmp_path / "aio.json"
    assert main(["tune", "--path", str(scratch), "--budget", "3", "--output", str(output), "--codec"]) == 1
    assert "pip install 'deepoffload[codec]'" in capsys.readouterr().err and not output.exists()
