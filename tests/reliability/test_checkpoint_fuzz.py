"""Damaged and crafted checkpoints, fuzzed (hypothesis, in checkpoint_fuzz.py): the zip headers and directory of a
small ``torch.save`` file, the header of a safetensors file and the ``.metadata`` of a DCP checkpoint are mutated;
every load equals the original or raises ``CheckpointError``. Each kind runs in a child process with its address
space capped (a load allocating more than ``checkpoint_fuzz.HEADROOM`` fails) and a timeout (a hang fails), with a
fixed seed and a bounded number of examples so that CI runs the same cases every time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["zip", "safetensors", "dcp"]


def fuzz(kind: str, examples: int, folder: Path, timeout: float) -> str:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.reliability.checkpoint_fuzz", kind, str(examples), str(folder)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"fuzzing {kind} checkpoints did not finish in {timeout} s: a load hangs")
    assert done.returncode == 0 and f"OK {kind}" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_mutated_checkpoint_headers_load_unchanged_or_raise_checkpoint_error(aio, tmp_path, kind):
    out = fuzz(kind, 60, tmp_path, timeout=300)
    assert "CheckpointError" in out  # the mutations did reach the checks


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_many_mutated_checkpoint_headers(aio, tmp_path, kind):
    fuzz(kind, 1000, tmp_path, timeout=1800)
