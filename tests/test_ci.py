"""ci/test.sh runs every phase and reports each even when one fails, and test runs leave no scratch files behind.
The CI script runs against a stand-in `python` that records its arguments, so no suite runs inside the suite."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not (REPO / "ci" / "test.sh").exists(), reason="needs the source tree")

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CI_LOG"
[[ "$1" == "-" ]] && cat > /dev/null          # sanitize.sh's check script, on stdin
[[ -n "${FAIL_ON:-}" && "$*" == *"$FAIL_ON"* ]] && exit 1
exit 0
"""


def run_ci(tmp_path: Path, fail_on: str = "") -> tuple[subprocess.CompletedProcess, list[str], Path]:
    bindir, tmp = tmp_path / "bin", tmp_path / "tmp"
    bindir.mkdir()
    tmp.mkdir()
    (bindir / "python").write_text(FAKE_PYTHON)
    (bindir / "python").chmod(0o755)
    log = tmp_path / "calls.log"
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "CI_LOG": str(log),
        "FAIL_ON": fail_on,
        "TMPDIR": str(tmp),
    }
    if shutil.which("g++") is None:
        pytest.skip("sanitize.sh needs g++ to find libasan")
    proc = subprocess.run(
        ["bash", str(REPO / "ci" / "test.sh"), "-k", "nothing"], capture_output=True, text=True, env=env, timeout=120
    )
    return proc, log.read_text().splitlines(), tmp


def test_every_phase_runs_when_one_fails(tmp_path):
    proc, calls, tmp = run_ci(tmp_path, fail_on="-O -m pytest")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert any(c.startswith("-O -m pytest") for c in calls)
    assert any("tests/io/test_handle.py tests/reliability" in c for c in calls), calls  # the sanitizer phase still ran
    out = proc.stdout
    assert "=== ci/test.sh: results" in out
    results = out[out.index("=== ci/test.sh: results") :]
    assert "full suite" in results and "core tests under python -O     FAILED (exit status 1)" in results
    sanitize = next(line for line in results.splitlines() if "sanitizers" in line)
    assert "FAILED" not in sanitize or "libasan" in proc.stderr
    assert list(tmp.iterdir()) == []  # the script's scratch folder (pytest temp, sanitizer cache) is gone


def test_all_phases_pass(tmp_path):
    proc, calls, tmp = run_ci(tmp_path)
    if "has no libasan.so" in proc.stderr:
        pytest.skip("no libasan here: the sanitizer phase cannot pass")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum("-m pytest" in c for c in calls) == 3
    assert calls[1] == "-m ruff check .", calls  # after the install: the lint phase
    assert "lint (ruff check, ruff format --check)" in proc.stdout[proc.stdout.index("=== ci/test.sh: results") :]
    assert any(c.startswith("-m mkdocs build --strict") for c in calls), calls
    assert "docs (mkdocs build --strict)" in proc.stdout[proc.stdout.index("=== ci/test.sh: results") :]
    assert list(tmp.iterdir()) == []


def test_the_docs_phase_runs_and_reports_when_the_others_fail(tmp_path):
    proc, calls, tmp = run_ci(tmp_path, fail_on="-m pytest")
    assert proc.returncode != 0
    assert calls[-1].startswith("-m mkdocs build --strict"), calls
    docs = next(line for line in proc.stdout.splitlines() if line.strip().startswith("docs (mkdocs"))
    assert "passed" in docs, docs


def test_the_tree_passes_the_lint_ci_runs():
    """The same check as CI's lint phase (skipped where ruff, a test dependency, is not installed)."""
    pytest.importorskip("ruff")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_passing_test_run_leaves_no_scratch_files(tmp_path):
    """With the project's pytest settings, a passing run removes its tmp_path folders (the suite writes about
    1.5 GB of them)."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_big.py").write_text(
        textwrap.dedent("""
        def test_writes(tmp_path):
            (tmp_path / "big.bin").write_bytes(b"x" * (1 << 20))
    """)
    )
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left = [p for p in tmp.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in left) < 1 << 20, left


def test_plain_install_requires_numpy():
    """torch warns "Failed to initialize NumPy" on import when numpy is missing, so a plain install (no test extra)
    needs it to keep every command's output clean."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "numpy" in [re.split(r"[<>=!~ ;\[]", r)[0] for r in project["dependencies"]]


def test_declared_ranges_are_the_tested_ones():
    """pyproject.toml declares the Python and torch floors CI tests (.ci/run installs torch 2.13.0 on Python 3.11),
    and the documentation says so."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert "torch>=2.13" in project["dependencies"]
    assert "torch==2.13.0" in (REPO / ".ci" / "run").read_text()
    assert "Python 3.11 with torch 2.13.0" in (REPO / "docs" / "getting-started.md").read_text()


def test_ci_installs_the_system_packages_the_docs_list():
    """.ci/run installs every package of the getting-started page's apt-get line, and the suite's own (strace, wine,
    MinGW): a fresh Debian machine lacked python3-dev (Python.h, for the op's build) and python3-venv."""
    docs = (REPO / "docs" / "getting-started.md").read_text()
    listed = re.search(r"sudo apt-get install -y ([^\n]+)", docs).group(1).split()
    ci = (REPO / ".ci" / "run").read_text()
    installed = re.search(r"apt-get install -y -qq --no-install-recommends ([^>]+)>", ci).group(1).replace("\\", " ")
    missing = set(listed + ["strace", "wine", "g++-mingw-w64-x86-64"]) - set(installed.split())
    assert not missing, missing
