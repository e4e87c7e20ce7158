"""The native core's own test programs, built with the system compiler: the planning unit tests (no IO, fast) and,
marked slow, the whole of tests/native/build_and_run.sh."""

from __future__ import annotations

import os
import shlex
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
    subprocess.run(
        [
            *_compiler().split(),
            "-O1",
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            str(REPO / "csrc/aio/plan.cpp"),
            str(HERE / "test_plan.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
    )
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("0 failed") and "FAIL" not in proc.stdout


@pytest.mark.slow
def test_build_and_run_script(tmp_path):
    _compiler()
    proc = subprocess.run(
        ["bash", str(HERE / "build_and_run.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith(" 0 failed")


def op_builder_main(*args: str, module: str = "op_builder") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, "flags", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_flags_command_prints_the_builders_flags():
    from op_builder.async_io import AsyncIOBuilder
    from op_builder.builder import WARNING_FLAGS

    builder = AsyncIOBuilder()
    results = builder.probe_results()
    cflags, ldflags = builder.build_flags(results)
    proc = op_builder_main()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"cflags: {shlex.join(cflags)}",
        f"ldflags: {shlex.join(ldflags)}",
        f"engines: {' '.join(builder.engines(results))}",
    ]
    assert shlex.split(op_builder_main("--cflags").stdout) == cflags
    assert shlex.split(op_builder_main("--ldflags").stdout) == ldflags
    assert set(WARNING_FLAGS) <= set(cflags)
    # installed as deepoffload.op_builder: the same command
    installed = op_builder_main("--warnings", module="deepoffload.op_builder")
    assert installed.returncode == 0 and shlex.split(installed.stdout) == list(WARNING_FLAGS)


def test_flags_command_without_a_feature():
    proc = op_builder_main("--cflags", "--ldflags", "--engines", "--without", "libaio", "--without", "liburing")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "HAVE_LIBAIO" not in text and "HAVE_URING" not in text and "-laio" not in text
    assert text.splitlines()[-1] == "engines: posix"
    bad = op_builder_main("--without", "cxx")
    assert bad.returncode == 2 and "--without: unknown probe cxx" in bad.stderr and "libaio" in bad.stderr
