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
    """pyproject.toml declares the Python and torch floors CI tests (ci/setup.sh installs torch 2.13.0 on Python
    3.11), and the documentation says so."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert "torch>=2.13" in project["dependencies"]
    assert "torch==2.13.0" in (REPO / "ci" / "setup.sh").read_text()
    assert "Python 3.11 with torch 2.13.0" in (REPO / "docs" / "getting-started.md").read_text()


def _versions():
    sys.path.insert(0, str(REPO / "ci"))
    try:
        import versions
    finally:
        sys.path.remove(str(REPO / "ci"))
    return versions


def test_extras_stop_at_the_tested_versions_and_the_docs_name_them():
    """The hf and deepspeed extras are bounded above by the test extra's pins (what CI installs and
    ci/versions.py prints), and the getting-started page's "What is tested" sentence is the one written from them."""
    import tomllib

    versions = _versions()
    pins = versions.pins()
    assert set(pins) == set(versions.INTEGRATIONS), pins
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for requirement in extras["hf"] + extras["deepspeed"]:
        name = re.split(r"[<>=!~ ;\[]", requirement)[0]
        assert f"<={pins[name]}" in requirement, (requirement, pins[name])
    page = " ".join((REPO / "docs" / "getting-started.md").read_text().split())
    assert versions.tested_sentence() in page


def test_ci_prints_the_tested_versions_and_fails_on_others():
    versions = _versions()
    proc = subprocess.run([sys.executable, str(REPO / "ci" / "versions.py")], capture_output=True, text=True)
    for name in ("torch", "transformers", "accelerate", "peft", "deepspeed"):
        assert f"tested with: {name} " in proc.stdout, proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr  # this venv holds the pins
    assert "python ci/versions.py" in (REPO / "ci" / "setup-tests.sh").read_text()
    pins, original = versions.pins(), versions.pins
    try:
        versions.pins = lambda: {**pins, "peft": "0.0.1"}  # a pin that is not what is installed
        assert versions.main() == 1
    finally:
        versions.pins = original


FAKE_TOOL = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$SETUP_LOG"
case "$(basename "$0")" in
  id) echo "$FAKE_UID" ;;
  dpkg-query) [[ " $PRESENT " == *" ${@: -1} "* ]] && echo -n "install ok installed" ;;
  sudo) exec "$@" ;;
esac
exit 0
"""


@pytest.mark.parametrize("uid,sudo,expected", [("0", False, "apt-get"), ("1000", True, "sudo"), ("1000", False, None)])
def test_setup_installs_system_packages_as_root_through_sudo_or_says_what_to_run(tmp_path, uid, sudo, expected):
    """As root apt-get runs directly (containers have no sudo), as a user through sudo; with neither, the message
    names the command to run as root. Packages already installed are not installed again."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("id", "dpkg-query", "apt-get", "bash", "grep", "env", "basename", "cat") + (("sudo",) if sudo else ()):
        if tool in ("id", "dpkg-query", "apt-get", "sudo"):
            (bindir / tool).write_text(FAKE_TOOL)
            (bindir / tool).chmod(0o755)
        else:
            (bindir / tool).symlink_to(shutil.which(tool))
    log = tmp_path / "calls.log"
    env = {"PATH": str(bindir), "SETUP_LOG": str(log), "FAKE_UID": uid, "PRESENT": "fio"}
    script = f". {REPO / 'ci' / 'setup.sh'}; system_packages g++ fio"
    proc = subprocess.run([str(bindir / "bash"), "-c", script], capture_output=True, text=True, env=env, timeout=60)
    calls = log.read_text().splitlines()
    installs = [c for c in calls if c.startswith("apt-get install")]
    if expected is None:
        assert proc.returncode != 0 and "not root and no sudo: as root, run:" in proc.stderr, proc.stderr
        assert not installs
        return
    assert proc.returncode == 0, proc.stderr
    assert len(installs) == 1 and installs[0].endswith(" g++"), calls  # fio is there already
    assert any(c.startswith(f"{expected} ") and "apt-get install" in c for c in calls), calls
    assert sudo == any(c.startswith("sudo ") for c in calls), calls


def test_setup_scripts_install_the_system_packages_the_docs_list():
    """ci/setup.sh (both set-up commands) installs every package of the getting-started page's apt-get line, and
    the tests' own (strace, wine, MinGW): a fresh Debian machine lacked python3-dev (Python.h) and python3-venv."""
    docs = (REPO / "docs" / "getting-started.md").read_text()
    listed = re.search(r"apt-get install -y ([^\n#]+)", docs).group(1).split()
    setup = (REPO / "ci" / "setup.sh").read_text()
    main = re.search(r"MAIN_PACKAGES=\(([^)]*)\)", setup).group(1).split()
    tests = re.search(r"TEST_PACKAGES=\(([^)]*)\)", setup).group(1).split()
    assert not set(listed) - set(main), set(listed) - set(main)
    assert {"strace", "wine", "g++-mingw-w64-x86-64"} <= set(tests)
    assert "bash ci/setup-tests.sh" in (REPO / ".ci" / "run").read_text()
    for page in (REPO / "README.md", REPO / "docs" / "getting-started.md"):  # root has no sudo in most containers
        assert "sudo apt-get install" not in page.read_text(), page


FAKE_STEP = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$SETUP_LOG"
case "$(basename "$0") $*" in
  "apt-get "*) exit "$FAKE_APT_STATUS" ;;
  "python -m pip "*) exit "$FAKE_PIP_STATUS" ;;
esac
exit 0
"""


@pytest.mark.parametrize("apt,pip", [(0, 0), (100, 0), (0, 1), (100, 1)])
def test_setup_commands_run_and_report_every_step_when_one_fails(tmp_path, apt, pip):
    """ci/setup-tests.sh (.ci/run) runs every step and reports each failure, so that a failed apt-get or pip install
    does not hide the suite's results; its status is non-zero when any step failed. ci/setup-demo.sh goes on to the
    demo without the system packages (deepoffload report then says what is missing) but stops when pip fails."""
    repo, bindir, venv_bin = tmp_path / "repo", tmp_path / "bin", tmp_path / "repo" / ".venv" / "bin"
    for folder in (repo / "ci", bindir, venv_bin):
        folder.mkdir(parents=True)
    for name in ("setup.sh", "setup-tests.sh", "setup-demo.sh"):
        shutil.copy(REPO / "ci" / name, repo / "ci" / name)
    (repo / "ci" / "test.sh").write_text('echo "ci/test.sh $*" >> "$SETUP_LOG"\n')
    for tool in ("id", "dpkg-query", "apt-get", "python", "deepoffload"):
        (bindir / tool).write_text(FAKE_STEP if tool != "id" else "#!/usr/bin/env bash\necho 0\n")
        (bindir / tool).chmod(0o755)
    (venv_bin / "activate").write_text("")  # made once: python_env does not make it again
    log = tmp_path / "calls.log"
    env = {
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "SETUP_LOG": str(log),
        "FAKE_APT_STATUS": str(apt),
        "FAKE_PIP_STATUS": str(pip),
    }
    proc = subprocess.run(
        ["bash", "ci/setup-tests.sh", "-k", "x"], cwd=repo, capture_output=True, text=True, env=env, timeout=60
    )
    calls = log.read_text()
    assert "python ci/versions.py" in calls and "ci/test.sh -k x" in calls, proc.stdout + proc.stderr
    assert ("=== system packages: FAILED" in proc.stdout) == bool(apt), proc.stdout
    assert ("=== python environment: FAILED" in proc.stdout) == bool(pip), proc.stdout
    assert (proc.returncode != 0) == bool(apt or pip), proc.stdout + proc.stderr
    log.write_text("")
    proc = subprocess.run(["bash", "ci/setup-demo.sh"], cwd=repo, capture_output=True, text=True, env=env, timeout=60)
    calls = log.read_text()
    assert ("deepoffload demo" in calls) == (not pip) and (proc.returncode != 0) == bool(pip), calls + proc.stderr
    if apt and not pip:
        assert "going on without them" in proc.stderr
