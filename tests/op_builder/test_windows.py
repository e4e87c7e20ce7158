"""Windows support, tested on Linux.

- The builder's Windows paths, by simulating the platform (``platform="win32"``): sources, probes, flags, engines,
  install hints and the compatibility report.
- The native core itself: cross-compiled with MinGW-w64 (Debian package ``g++-mingw-w64-x86-64``) together with
  tests/native/test_core.cpp and tests/native/test_windows.cpp, and run under Wine (Debian package ``wine``). Skipped,
  saying why, where either is missing or Wine cannot start. The executables and the Wine prefix live in this
  module's temporary folder only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from deepoffload.op_builder import AsyncIOBuilder, Toolchain
from deepoffload.op_builder.build_errors import build_hint
from deepoffload.op_builder.builder import SANITIZE_ENV
from deepoffload.op_builder.hints import install_hint
from deepoffload.op_builder.probes import ProbeResult

from deepoffload import diagnostics
from deepoffload.cli import report

REPO = Path(__file__).resolve().parents[2]
MINGW = "x86_64-w64-mingw32-g++-posix"  # GCC 12's MinGW has std::thread only with the posix thread model
LIBRARY_PROBES = ("libaio", "io_pgetevents", "liburing")
BUILD_TIMEOUT_S = 600
WINE_TIMEOUT_S = 300


# -- the builder on a simulated Windows ---------------------------------------------------------------------------
@pytest.fixture
def win_builder() -> AsyncIOBuilder:
    return AsyncIOBuilder(Toolchain.from_environment(environ={}, platform="win32"), platform="win32")


@pytest.fixture
def win_results(win_builder) -> dict[str, ProbeResult]:
    return win_builder.probe_results(use_cache=False)


def test_toolchain_defaults_to_msvc_on_windows():
    tc = Toolchain.from_environment(environ={}, platform="win32")
    assert tc.is_windows and tc.compiler == "cl"
    assert Toolchain.from_environment(environ={"CXX": "clang-cl"}, platform="win32").compiler == "clang-cl"
    assert not Toolchain.from_environment(environ={}, platform="linux").is_windows


def test_windows_sources_exclude_posix_files(win_builder):
    names = {p.name for p in win_builder.source_files()}
    assert {"platform_windows.cpp", "engine_windows.cpp", "io_handle.cpp", "engine.cpp", "binding.cpp"} <= names
    assert not [n for n in names if n.endswith("_posix.cpp")]
    linux = {p.name for p in AsyncIOBuilder(platform="linux").source_files()}
    assert "platform_posix.cpp" in linux and not [n for n in linux if n.endswith("_windows.cpp")]


def test_windows_runs_no_library_probes(win_builder, win_results):
    assert [p.name for p in win_builder.probes()] == ["cxx"]
    for name in LIBRARY_PROBES:
        r = win_results[name]
        assert not r.ok and not r.applicable and r.reason == "not applicable on Windows"
    # No MSVC on this machine: the compiler probe fails and says so, without raising.
    assert not win_results["cxx"].ok and "'cl' not found" in win_results["cxx"].reason


def test_windows_flags_are_msvc_flags(win_builder, win_results, monkeypatch):
    monkeypatch.setenv(SANITIZE_ENV, "address")  # sanitizers are a GCC/Clang option; ignored for MSVC
    results = {**win_results, "cxx": ProbeResult("cxx", True)}
    cflags, ldflags = win_builder.build_flags(results)
    assert cflags[:3] == ["/O2", "/std:c++17", "/EHsc"]
    assert not [f for f in cflags + ldflags if f.startswith("-")], (cflags, ldflags)
    assert win_builder.feature_flags(results) == ([], [])


def test_auto_selects_the_windows_engine(win_builder, win_results):
    # Even when a (stale) cache says libaio and liburing work, a Windows build has the Windows engine only.
    linux_like = {**win_results, **{n: ProbeResult(n, True) for n in LIBRARY_PROBES}}
    assert win_builder.engines(win_results) == ["windows"]
    assert win_builder.engines(linux_like) == ["windows"]
    assert "windows" not in AsyncIOBuilder(platform="linux").engines(linux_like)


def test_windows_install_hints():
    hint = install_hint("cxx", "win32")
    assert "Visual Studio Build Tools" in hint and "ninja" in hint and "apt" not in hint
    for name in LIBRARY_PROBES:
        assert install_hint(name, "win32") == "not applicable on Windows"
    missing_cl = build_hint(["'cl' is not recognized as an internal or external command"], "win32")
    assert "Visual Studio Build Tools" in missing_cl and "apt-get" not in missing_cl


def test_report_on_simulated_windows(win_builder, win_results):
    versions = diagnostics.versions(win_builder)
    assert "libaio" not in versions and "liburing" not in versions
    assert versions["compiler"] == "cl (not found)"
    row = diagnostics.op_status(win_builder, win_results)
    assert row["engines_buildable"] == ["windows"]
    assert not row["compatible"]  # no compiler and no prebuilt op
    for name in LIBRARY_PROBES:
        assert row["probes"][name]["status"] == "n/a"
    assert row["probes"]["cxx"]["status"] == "missing"
    assert "Visual Studio Build Tools" in row["probes"]["cxx"]["hint"]
    text = report.render({"versions": versions, "ops": [row]}, report.Style(False))
    for name in LIBRARY_PROBES:
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        assert "n/a" in line and "not applicable on Windows" in line and "missing" not in line
    assert "cxx: install Visual Studio Build Tools" in text
    assert "windows (when built)" in text
    assert "apt-get" not in text and "libaio-dev" not in text


def test_report_on_simulated_windows_with_a_compiler(win_builder, win_results):
    row = diagnostics.op_status(win_builder, {**win_results, "cxx": ProbeResult("cxx", True)})
    assert row["compatible"] and row["probes"]["cxx"]["status"] == "ok"
    assert row["engines"] == {} and row["auto_engine"] is None  # never loads a foreign platform's op
    text = report.render({"versions": diagnostics.versions(win_builder), "ops": [row]}, report.Style(False))
    assert "the op builds on first use" in text and "Visual Studio" not in text


# -- the native core under Wine -----------------------------------------------------------------------------------
def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def wine_env(tmp_path_factory) -> dict[str, str]:
    """Environment for running Windows programs under Wine in a fresh prefix; skips when Wine cannot start."""
    if shutil.which(MINGW) is None:
        pytest.skip(f"{MINGW} not found: install the Debian package g++-mingw-w64-x86-64 to test the Windows engine")
    if shutil.which("wine") is None:
        pytest.skip("wine not found: install the Debian package wine to test the Windows engine")
    work = tmp_path_factory.mktemp("wine")
    env = {**os.environ, "WINEPREFIX": str(work / "prefix"), "WINEDEBUG": "-all"}
    hello = work / "hello.cpp"
    hello.write_text('#include <cstdio>\nint main() { std::puts("wine works"); return 0; }\n')
    subprocess.run([MINGW, "-static", str(hello), "-o", str(work / "hello.exe")], check=True, timeout=BUILD_TIMEOUT_S)
    try:  # the first start creates the prefix (about 15 s)
        proc = subprocess.run(
            ["wine", str(work / "hello.exe")], env=env, capture_output=True, text=True, timeout=WINE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"Wine did not start a trivial program within {WINE_TIMEOUT_S} s")
    if proc.returncode != 0 or "wine works" not in proc.stdout:
        pytest.skip(
            f"Wine cannot start a trivial program here (exit {proc.returncode}): {_tail(proc.stderr + proc.stdout, 3)}"
        )
    return env


@pytest.fixture(scope="module")
def windows_programs(wine_env, tmp_path_factory) -> Path:
    """test_core.exe and test_windows.exe, cross-compiled once per test run."""
    out = tmp_path_factory.mktemp("windows-exe")
    proc = subprocess.run(
        [str(REPO / "tests/native/build_windows.sh"), str(out)],
        env={**wine_env, "RUN": "0"},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"MinGW build failed:\n{_tail(proc.stdout + proc.stderr, 40)}"
    return out


def _run_under_wine(env: dict[str, str], exe: Path, *args: str) -> tuple[int, int, str]:
    """(passed, failed, output) of a native test program run under Wine."""
    proc = subprocess.run(["wine", str(exe), *args], env=env, capture_output=True, text=True, timeout=WINE_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    m = re.search(r"(\d+) passed, (\d+) failed", output)
    assert m, f"{exe.name} did not finish (exit {proc.returncode}):\n{_tail(output)}"
    assert proc.returncode == (0 if m.group(2) == "0" else 1), output
    return int(m.group(1)), int(m.group(2)), output


def _unix_to_wine(path: Path) -> str:
    return "Z:" + str(path)  # Wine maps the Unix root to drive Z:


@pytest.mark.slow
def test_core_under_wine(windows_programs, wine_env, tmp_path):
    passed, failed, output = _run_under_wine(wine_env, windows_programs / "test_core.exe", _unix_to_wine(tmp_path))
    fails = [line for line in output.splitlines() if line.startswith("FAIL")]
    assert failed == 0, "\n".join(fails)
    assert "engine windows: self test ok" in output
    assert passed > 100  # round trips at odd sizes and offsets, concurrency, errors, lifecycle


@pytest.mark.slow
def test_windows_specifics_under_wine(windows_programs, wine_env, tmp_path):
    passed, failed, output = _run_under_wine(wine_env, windows_programs / "test_windows.exe", _unix_to_wine(tmp_path))
    assert failed == 0, "\n".join(line for line in output.splitlines() if line.startswith("FAIL"))
    assert "skip: Z:/dev/full" not in output  # under Wine the full device is reachable as Z:/dev/full
    assert passed > 20


@pytest.mark.slow
@pytest.mark.root
def test_disk_full_under_wine(windows_programs, wine_env, tmp_path, small_fs):
    """An 8 MiB write to a 1 MiB volume fails with ENOSPC carrying the Windows code, and the program goes on."""
    volume = small_fs(1 << 20, "tmpfs")
    passed, failed, output = _run_under_wine(
        wine_env, windows_programs / "test_windows.exe", _unix_to_wine(tmp_path), _unix_to_wine(volume)
    )
    assert failed == 0, "\n".join(line for line in output.splitlines() if line.startswith("FAIL"))
    assert "skip: no small volume" not in output and passed > 20
