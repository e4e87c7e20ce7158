"""The scripts in examples/ run at their tiny size and report that their results match the reference they check
against (each exits non-zero when one does not); every example is shown in the documentation, included from the
file rather than copied."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
pytestmark = pytest.mark.skipif(not EXAMPLES, reason="needs the source tree's examples/")

NEEDS = {
    "hf_stream_generate.py": ["transformers"],
    "trainer_streaming.py": ["transformers", "accelerate"],
    "deepspeed_zero3.py": ["deepspeed"],
    "checkpoints.py": ["safetensors"],
}


def test_there_are_at_least_five_examples_each_with_a_tiny_size_and_a_usage_line():
    assert len(EXAMPLES) >= 5
    for path in EXAMPLES:
        text = path.read_text()
        assert '"--tiny"' in text, f"{path.name} has no --tiny size"
        assert f"python examples/{path.name}" in text, f"{path.name}'s docstring does not say how to run it"


def test_every_example_is_included_in_the_docs():
    docs = "\n".join(p.read_text() for p in (REPO / "docs").rglob("*.md"))
    included = set(re.findall(r'--8<-- "examples/([\w.]+?\.py)(?::\w+)?"', docs))
    assert {p.name for p in EXAMPLES} <= included, {p.name for p in EXAMPLES} - included


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_at_its_tiny_size(path, tmp_path):
    for module in NEEDS.get(path.name, []):
        pytest.importorskip(module)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(path), "--tiny", "--folder", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "NO" not in re.findall(r"\b(?:yes|NO)\b", proc.stdout) and "WRONG" not in proc.stdout, proc.stdout
