"""Just-in-time build: first build, warm load, rebuild on change, many processes building once, recovery from a
builder killed mid-build, and a corrupted cached library. Each test builds into its own empty cache."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deepoffload.op_builder import AsyncIOBuilder
from deepoffload.op_builder.builder import CSRC

BUILDING = "deepoffload: building the async_io op"
LOAD_SCRIPT = """
import sys, time
from deepoffload.op_builder import AsyncIOBuilder
start = time.monotonic()
module = AsyncIOBuilder(csrc=sys.argv[1]).jit_load()  # the JIT path, even where a prebuilt op is installed
print("LOADED", module.__file__, ",".join(module.engines()), round(time.monotonic() - start, 3), flush=True)
"""

pytestmark = pytest.mark.slow


def loader(cache: Path, csrc: Path = CSRC, **popen) -> subprocess.Popen:
    env = {**os.environ, "DEEPOFFLOAD_CACHE_DIR": str(cache)}
    return subprocess.Popen(
        [sys.executable, "-c", LOAD_SCRIPT, str(csrc)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def load_in_subprocess(cache: Path, csrc: Path = CSRC, timeout: float = 300) -> tuple[str, str]:
    proc = loader(cache, csrc)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    assert "LOADED" in out, out + err
    return out, err


def test_first_build_then_warm_load(tmp_path):
    cache = tmp_path / "cache"
    out, err = load_in_subprocess(cache)
    assert err.count(BUILDING) == 1, "the first use says once, on stderr, that it is building"
    assert "first use for this torch and compiler" in err
    builds = list((cache / "build").glob("async_io-*/ready.json"))
    assert len(builds) == 1
    record = json.loads(builds[0].read_text())
    assert "-O2" in record["cflags"] and not any("march=native" in f for f in record["cflags"])
    out2, err2 = load_in_subprocess(cache)
    assert BUILDING not in err2, "a warm load must not build"
    assert out2.split()[1] == out.split()[1], "the warm load uses the cached library"


def test_many_processes_build_once_and_all_load(tmp_path):
    cache = tmp_path / "cache"
    procs = [loader(cache) for _ in range(4)]
    results = [p.communicate(timeout=400) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    assert all("LOADED" in out for out, _ in results)
    assert sum(err.count(BUILDING) for _, err in results) == 1, "four ranks starting at once build the op once"
    assert len({out.split()[1] for out, _ in results}) == 1


def test_killed_builder_does_not_block_the_next(tmp_path):
    cache = tmp_path / "cache"
    proc = loader(cache, start_new_session=True)
    deadline = time.monotonic() + 120
    line = ""
    while BUILDING not in line and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
    assert BUILDING in line, "the builder never started"
    time.sleep(2.0)  # the compiler is running now
    os.killpg(proc.pid, signal.SIGKILL)  # the builder and its ninja/compiler children, like an OOM kill
    proc.wait()
    out, err = load_in_subprocess(cache, timeout=300)
    assert err.count(BUILDING) == 1


def test_source_change_rebuilds_and_flags_change_the_key(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DEEPOFFLOAD_CACHE_DIR", str(cache))
    builder = AsyncIOBuilder(csrc=csrc)
    cflags, ldflags = builder.build_flags()
    key = builder.build_key(cflags, ldflags)
    assert builder.build_key([*cflags, "-DEXTRA"], ldflags) != key, "a flag change must change the build"
    out1, _ = load_in_subprocess(cache, csrc)
    header = csrc / "aio" / "engine.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert builder.build_key(cflags, ldflags) != key, "a header change must change the build"
    out2, err2 = load_in_subprocess(cache, csrc)
    assert err2.count(BUILDING) == 1
    assert out1.split()[1] != out2.split()[1]


def test_corrupted_cached_library_is_rebuilt_with_a_warning(tmp_path):
    cache = tmp_path / "cache"
    out, _ = load_in_subprocess(cache)
    library = Path(out.split()[1])
    library.write_bytes(library.read_bytes()[:4096])  # truncated, as by a full disk or a killed copy
    out2, err2 = load_in_subprocess(cache)
    assert "discarding the cached async_io build" in err2
    assert err2.count(BUILDING) == 1
    library.write_bytes(b"garbage" * 100)
    record = library.parent / "ready.json"
    data = json.loads(record.read_text())
    data["sha256"] = __import__("hashlib").sha256(library.read_bytes()).hexdigest()  # even with a matching hash
    record.write_text(json.dumps(data))
    out3, err3 = load_in_subprocess(cache)
    assert "does not load" in err3 and err3.count(BUILDING) == 1


def test_failed_build_raises_with_compiler_lines_and_hint(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    (csrc / "aio" / "broken.cpp").write_text("#include <deepoffload_missing_header.h>\nint x = ;\n")
    monkeypatch.setenv("DEEPOFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    from deepoffload.op_builder import BuildError

    with pytest.raises(BuildError) as info:
        AsyncIOBuilder(csrc=csrc).jit_load()
    assert any("deepoffload_missing_header.h" in line for line in info.value.compiler_lines)
    assert info.value.hint
    assert "hint:" in str(info.value)


def test_missing_compiler_raises_build_error_with_install_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPOFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "deepoffload-no-such-compiler")
    from deepoffload.op_builder import BuildError

    with pytest.raises(BuildError) as info:
        AsyncIOBuilder().jit_load()
    assert "install" in info.value.hint
