"""The command line with what users do to it: output piped to a reader that leaves (``| head``), budgets and sizes
it cannot honour, Ctrl-C inside a baseline."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from deepoffload.bench import baselines
from deepoffload.bench.measure import available_memory
from deepoffload.cli.main import main


def run_with_reader_gone(argv: list[str]) -> subprocess.CompletedProcess:
    """``deepoffload ARGV`` with stdout a pipe whose reader has already left (as ``| head`` does once satisfied)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "deepoffload", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=240,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "command", ["report", "report --json", "bench --size 1M --loops 1", "bench --size 1M --loops 1 --json"]
)
def test_reader_gone_stops_quietly(aio, scratch, command):
    argv = command.split() + (["--path", str(scratch)] if command.startswith("bench") else [])
    result = run_with_reader_gone(argv)
    assert result.returncode == 141, result.stderr  # 128 + SIGPIPE, like a process the signal ended
    assert "Traceback" not in result.stderr and "Broken pipe" not in result.stderr, result.stderr
    assert not [p for p in scratch.iterdir() if p.name.startswith(".deepoffload-bench")]


def test_tune_writes_its_config_even_when_the_reader_left(aio, scratch):
    output = scratch / "aio.json"
    result = run_with_reader_gone(
        ["tune", "--path", str(scratch), "--size", "1M", "--budget", "3", "--output", str(output)]
    )
    assert result.returncode == 141 and "Traceback" not in result.stderr, result.stderr
    assert set(json.loads(output.read_text())) >= {"block_size", "queue_depth", "engine"}


@pytest.mark.parametrize("budget", ["nan", "inf", "0"])
def test_tune_budget_must_be_finite_and_positive(scratch, capsys, budget):
    assert main(["tune", "--path", str(scratch), "--budget", budget, "--output", str(scratch / "a.json")]) == 1
    err = capsys.readouterr().err
    assert "--budget must be a positive number of seconds (not inf or nan)" in err and "Traceback" not in err
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_size_beyond_memory_says_so(scratch, capsys, command):
    available = available_memory()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    size = str(2 * available)
    assert (
        main(
            [
                command,
                "--path",
                str(scratch),
                "--size",
                size,
                "--output" if command == "tune" else "--loops",
                str(scratch / "a.json") if command == "tune" else "1",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert f"the {size}-byte test buffer" in err and "does not fit in memory" in err and "smaller --size" in err
    assert list(scratch.iterdir()) == []


def test_ctrl_c_inside_the_torch_save_baseline_is_an_interrupt(scratch, monkeypatch):
    """torch's zip writer, finalized while a KeyboardInterrupt propagates, raised its own 'enforce fail ... unexpected
    pos' RuntimeError, so `deepoffload bench --baselines` died with a traceback instead of 'interrupted'."""

    class InterruptedFile(io.FileIO):
        writes = 0

        def write(self, data):
            n = super().write(data)
            InterruptedFile.writes += 1
            if InterruptedFile.writes == 3:  # Ctrl-C arriving after some records were written
                raise KeyboardInterrupt
            return n

    monkeypatch.setattr(
        baselines, "open", lambda path, mode: InterruptedFile(path, mode.replace("b", "")), raising=False
    )
    with pytest.raises(KeyboardInterrupt):
        baselines.torch_save(torch.zeros(1 << 20, dtype=torch.uint8), scratch / "baseline.pt")


def test_ctrl_c_during_bench_exits_130_saying_interrupted_and_removes_the_test_file(aio, scratch, monkeypatch, capsys):
    """What docs/guides/bench-and-tune.md promises for Ctrl-C: `interrupted`, status 130, no test file left, also
    when it arrives inside the torch.save baseline."""

    class InterruptedFile(io.FileIO):
        def write(self, data):
            super().write(data)
            raise KeyboardInterrupt  # Ctrl-C arriving once the baseline has started writing

    monkeypatch.setattr(
        baselines, "open", lambda path, mode: InterruptedFile(path, mode.replace("b", "")), raising=False
    )
    code = main(["bench", "--path", str(scratch), "--size", "1M", "--loops", "1", "--baselines"])
    assert code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
    assert list(scratch.iterdir()) == []
