"""The native core's own test programs, built with the system compiler: the planning unit tests (no IO, fast) and,
marked slow, the whole of tests/native/build_and_run.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CXX = os.environ.get("CXX", "g++")


def _compiler() -> str:
    if shutil.which(CXX.split()[0]) is None:
        pytest.skip(f"no C++ compiler ({CXX}) to build the native tests")
    return CXX


def test_planning_unit_tests(tmp_path):
    exe = tmp_path / "test_plan"
    subprocess.run([*_compiler().split(), "-O1", "-std=c++17", "-Wall", "-Wextra", "-Werror",
                    str(REPO / "csrc/aio/plan.cpp"), str(HERE / "test_plan.cpp"), "-o", str(exe)], check=True)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("0 failed") and "FAIL" not in proc.stdout


@pytest.mark.slow
def test_build_and_run_script(tmp_path):
    _compiler()
    proc = subprocess.run(["bash", str(HERE / "build_and_run.sh"), str(tmp_path)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith(" 0 failed")
