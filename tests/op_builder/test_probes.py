"""Probes: present capabilities pass, missing headers/functions fail with their reason, user flags reach both the
probe and the build, and the on-disk cache is reused until the flags change."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from deepoffload.op_builder import AsyncIOBuilder, Toolchain
from deepoffload.op_builder import probes as probes_mod
from deepoffload.op_builder.probes import Probe, function_probe, run_probe, run_probes

needs_cxx = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
needs_libaio = pytest.mark.skipif(not Path("/usr/include/libaio.h").exists(), reason="libaio-dev not installed")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPOFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def toolchain(**env) -> Toolchain:
    return Toolchain.from_environment(env)


@needs_cxx
def test_compiler_probe_passes():
    assert run_probe(function_probe("cxx", "cstdio", 'std::puts("");'), toolchain()).ok


@needs_cxx
@needs_libaio
def test_present_library_passes():
    builder = AsyncIOBuilder(toolchain=toolchain())
    results = run_probes(builder.probes(), builder.toolchain, use_cache=False)
    assert results["libaio"].ok, results["libaio"]


@needs_cxx
def test_missing_header_fails_with_its_name():
    r = run_probe(function_probe("nothing", "deepoffload_no_such_header.h", "return 0;"), toolchain())
    assert not r.ok
    assert "deepoffload_no_such_header.h" in r.reason
    assert r.output_tail, "the failed probe keeps the compiler's last lines for the report"


@needs_cxx
@needs_libaio
def test_missing_function_fails_with_its_name():
    r = run_probe(function_probe("fake", "libaio.h", "io_deepoffload_does_not_exist(0);", ("aio",)), toolchain())
    assert not r.ok
    assert "io_deepoffload_does_not_exist" in r.reason


@needs_cxx
@needs_libaio
def test_empty_sysroot_hides_the_library(tmp_path):
    sysroot = tmp_path / "empty-sysroot"
    sysroot.mkdir()
    builder = AsyncIOBuilder(toolchain=toolchain(CFLAGS=f"--sysroot={sysroot}"))
    results = run_probes(builder.probes(), builder.toolchain, use_cache=False)
    assert not results["libaio"].ok
    assert "libaio.h" in results["libaio"].reason or "No such file" in results["libaio"].reason
    assert not results["liburing"].ok


@needs_cxx
def test_missing_compiler_is_a_reason_not_a_crash():
    r = run_probe(function_probe("cxx", "cstdio", ""), toolchain(CXX="deepoffload-no-such-compiler"))
    assert not r.ok and "not found" in r.reason


@needs_cxx
def test_cflags_reach_the_probe():
    probe = Probe("marker", "#ifndef DEEPOFFLOAD_MARKER\n#error marker flag missing\n#endif\nint main(){return 0;}\n")
    assert not run_probe(probe, toolchain()).ok
    assert run_probe(probe, toolchain(CFLAGS="-DDEEPOFFLOAD_MARKER=1")).ok


@needs_cxx
def test_ldflags_reach_probe_and_build_with_rpath(tmp_path):
    libdir = tmp_path / "prefix" / "lib"
    incdir = tmp_path / "prefix" / "include"
    libdir.mkdir(parents=True)
    incdir.mkdir(parents=True)
    (incdir / "dprobe.h").write_text("int dprobe_answer(void);\n")
    src = tmp_path / "dprobe.c"
    src.write_text("int dprobe_answer(void) { return 42; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(libdir / "libdprobe.so")], check=True)
    probe = function_probe("dprobe", "dprobe.h", "(void)dprobe_answer();", ("dprobe",))
    probe = Probe(probe.name, 'extern "C" {\n' + probe.source.replace("int main", "}\nint main", 1), probe.libraries)
    assert not run_probe(probe, toolchain()).ok
    tc = toolchain(CFLAGS=f"-I{incdir}", LDFLAGS=f"-L{libdir}")
    assert run_probe(probe, tc).ok
    assert tc.rpath_flags("dprobe") == [f"-Wl,-rpath,{libdir}"]
    # the same user flags reach the real build's command line
    cflags, ldflags = AsyncIOBuilder(toolchain=tc).build_flags(
        {n: probes_mod.ProbeResult(n, False) for n in ("cxx", "libaio", "io_pgetevents", "liburing")}
    )
    assert f"-I{incdir}" in cflags and f"-L{libdir}" in ldflags


def test_conda_prefix_adds_include_lib_and_rpath(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libaio.so.1").write_bytes(b"")
    tc = toolchain(CONDA_PREFIX=str(tmp_path))
    assert f"-I{tmp_path / 'include'}" in tc.cflags
    assert f"-L{tmp_path / 'lib'}" in tc.ldflags
    assert tc.rpath_flags("aio") == [f"-Wl,-rpath,{tmp_path / 'lib'}"]


@needs_cxx
def test_cache_is_reused_and_invalidated_by_flags(cache, monkeypatch):
    builder = AsyncIOBuilder(toolchain=toolchain())
    first = run_probes(builder.probes(), builder.toolchain)
    calls = []
    monkeypatch.setattr(
        probes_mod, "run_probe", lambda p, t: calls.append(p.name) or probes_mod.ProbeResult(p.name, True)
    )
    again = run_probes(builder.probes(), builder.toolchain)
    assert calls == [] and again == first, "a warm probe run must not compile anything"
    flagged = toolchain(CFLAGS="-DDEEPOFFLOAD_SOMETHING=1")
    assert flagged.identity() != builder.toolchain.identity()
    run_probes(builder.probes(), flagged)
    assert sorted(calls) == sorted(p.name for p in builder.probes()), "changed flags must re-run every probe"


@needs_cxx
def test_feature_selection_follows_probes():
    builder = AsyncIOBuilder(toolchain=toolchain())
    R = probes_mod.ProbeResult
    only_old_libaio = {
        "cxx": R("cxx", True),
        "libaio": R("libaio", True),
        "io_pgetevents": R("io_pgetevents", False),
        "liburing": R("liburing", False),
    }
    cflags, ldflags = builder.feature_flags(only_old_libaio)
    assert "-DDEEPOFFLOAD_HAVE_LIBAIO=1" in cflags and "-laio" in ldflags
    assert "-DDEEPOFFLOAD_HAVE_PGETEVENTS=1" not in cflags, "an older libaio reaps with io_getevents, no failure"
    assert "-DDEEPOFFLOAD_HAVE_URING=1" not in cflags
    assert builder.engines(only_old_libaio) == ["libaio", "posix"]
    nothing = {k: R(k, k == "cxx") for k in only_old_libaio}
    assert builder.feature_flags(nothing) == ([], [])
    assert builder.engines(nothing) == ["posix"], "the portable engine needs nothing but a compiler"


def test_release_flags_are_optimised_and_portable():
    cflags, _ = AsyncIOBuilder(toolchain=toolchain()).build_flags(
        {n: probes_mod.ProbeResult(n, True) for n in ("cxx", "libaio", "io_pgetevents", "liburing")}
    )
    assert "-O2" in cflags or "-O3" in cflags
    assert not any("march=native" in f for f in cflags)


def test_msvc_probe_command_line(monkeypatch):
    """On Windows the probe speaks cl's language: /Fe for the output, libraries after /link."""
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(probes_mod.subprocess, "run", fake_run)
    tc = Toolchain("cl", "C:/VS/cl.exe", cflags=("/O2",), platform="win32")
    assert run_probe(Probe("x", "int main(){return 0;}", ("aio",)), tc).ok
    (cmd,) = seen
    assert cmd[0] == "cl" and "/O2" in cmd and any(a.startswith("/Fe") for a in cmd)
    assert cmd[cmd.index("/link") + 1 :] == ["aio.lib"] and "-o" not in cmd
