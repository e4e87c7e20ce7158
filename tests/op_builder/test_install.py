"""Installing: a plain wheel compiles nothing and still builds the op just in time from a fresh venv outside the
source tree; a wheel prebuilt with DEEPOFFLOAD_BUILD_AIO=1 carries the op and loads it without compiling, and falls
back to a JIT build (with a warning) when torch does not match.

The fresh venvs see the test environment's torch through a .pth file (installing torch again would take minutes);
everything of deepoffload comes from the wheel under test. Wheels are built from a copy of the tracked files, so
build leftovers in the work tree cannot leak into them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BUILDING = "deepoffload: building the async_io op"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (REPO / "setup.py").exists(), reason="builds wheels from the source tree, which is not here"
    ),
]


def source_copy(dest: Path) -> Path:
    if (REPO / ".git").exists():
        files = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
    else:
        files = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()]
    for name in files:
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def build_wheel(tmp: Path, prebuild: bool) -> Path:
    src = source_copy(tmp / "src")
    env = {**os.environ}
    env.pop("DEEPOFFLOAD_BUILD_OPS", None)
    env["DEEPOFFLOAD_BUILD_AIO"] = "1" if prebuild else "0"
    out = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("deepoffload-*.whl")
    return wheel


def fresh_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    torch_site = str(Path(torch.__file__).resolve().parent.parent)
    Path(purelib, "_deepoffload_test_torch.pth").write_text(torch_site + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return venv


def run_in(venv: Path, code: str, tmp: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["DEEPOFFLOAD_CACHE_DIR"] = str(cache)
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], cwd=tmp, capture_output=True, text=True, env=env, timeout=600
    )


USE_OP = """
import os, torch, deepoffload
from deepoffload.op_builder import AsyncIOBuilder
module = AsyncIOBuilder().load_native()
print("MODULE", module.__file__)
print("PACKAGE", deepoffload.__file__)
with deepoffload.AsyncIOHandle() as h:
    t = torch.arange(100_003, dtype=torch.int32)
    h.write(t, "roundtrip.bin")
    back = torch.empty_like(t)
    h.read(back, "roundtrip.bin")
    print("ROUNDTRIP", bool(torch.equal(back, t)))
"""


def use_op(venv: Path, run_dir: Path, cache: Path) -> subprocess.CompletedProcess:
    """Run USE_OP in ``venv`` from ``run_dir``; it must succeed and round-trip a tensor."""
    proc = run_in(venv, USE_OP, run_dir, cache)
    assert proc.returncode == 0, proc.stderr
    assert "ROUNDTRIP True" in proc.stdout
    return proc


def test_plain_wheel_has_sources_and_builds_from_a_fresh_venv(tmp_path):
    wheel = build_wheel(tmp_path, prebuild=False)
    names = zipfile.ZipFile(wheel).namelist()
    assert "deepoffload/csrc/aio/io_handle.cpp" in names and "deepoffload/csrc/aio/engine.h" in names
    assert "deepoffload/op_builder/async_io.py" in names
    assert "deepoffload/py.typed" in names  # PEP 561: type checkers read the package's hints
    assert not any(n.startswith("op_builder/") for n in names), "no generic top-level op_builder package"
    assert not any(n.endswith(".so") for n in names), "a plain install compiles nothing"
    # the PEP 621 metadata of pyproject.toml, the license and the typing marker reach the wheel
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for line in (
        "License-Expression: Apache-2.0",
        "Requires-Python: >=3.11",
        "Requires-Dist: torch>=2.13",
        "Classifier: Typing :: Typed",
        "Provides-Extra: docs",
    ):
        assert line in metadata.splitlines(), line
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names) and "deepoffload/py.typed" in names
    from deepoffload.integrations import deepspeed_children as children

    # at the wheel's top, so it lands in site-packages (tests/integrations/test_deepspeed_children.py: what the line
    # does)
    assert zipfile.ZipFile(wheel).read(children.PTH_NAME).decode() == children.PTH_LINE + "\n"
    venv = fresh_venv(tmp_path, wheel)
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    proc = use_op(venv, run_dir, tmp_path / "cache")
    assert str(venv) in proc.stdout.split("PACKAGE ")[1], "deepoffload came from the fresh venv"
    assert proc.stderr.count(BUILDING) == 1
    report = subprocess.run(
        [str(venv / "bin" / "deepoffload"), "report", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "DEEPOFFLOAD_CACHE_DIR": str(tmp_path / "cache")},
        cwd=run_dir,
    )
    assert report.returncode == 0 and json.loads(report.stdout)["ops"][0]["built"]


def test_prebuilt_wheel_loads_without_compiling_and_falls_back_on_torch_mismatch(tmp_path):
    wheel = build_wheel(tmp_path, prebuild=True)
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("deepoffload/_ops/deepoffload_aio") and n.endswith(".so") for n in names)
    assert "deepoffload/_ops/build_info.json" in names
    venv = fresh_venv(tmp_path, wheel)
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    proc = use_op(venv, run_dir, tmp_path / "cache")
    assert BUILDING not in proc.stderr, "the prebuilt op loads without compiling"
    assert "/_ops/deepoffload_aio" in proc.stdout.split("MODULE ")[1].splitlines()[0]
    bare = run_in(
        venv,
        "import sys; from deepoffload.op_builder import AsyncIOBuilder; "
        "m = AsyncIOBuilder().load_native(); print(m.__file__, 'torch' in sys.modules)",
        run_dir,
        tmp_path / "cache",
    )
    assert bare.returncode == 0 and BUILDING not in bare.stderr and "does not load" not in bare.stderr, bare.stderr
    assert "/_ops/deepoffload_aio" in bare.stdout and bare.stdout.split()[-1] == "False", (
        "the prebuilt op loads without torch (it links none of torch's libraries)"
    )
    (info_path,) = venv.glob("lib/python*/site-packages/deepoffload/_ops/build_info.json")
    info = json.loads(info_path.read_text())
    assert info["torch"] == torch.__version__ and "async_io" in info["ops"]
    assert info["ops"]["async_io"]["probes"]["cxx"]["ok"] and "posix" in info["ops"]["async_io"]["engines"]
    info["torch"] = "1.0.0"
    info_path.write_text(json.dumps(info))
    proc = use_op(venv, run_dir, tmp_path / "cache")
    assert "built for torch 1.0.0" in proc.stderr and proc.stderr.count(BUILDING) == 1


def test_requested_prebuild_without_a_compiler_fails_the_install(tmp_path):
    src = source_copy(tmp_path / "src")
    env = {**os.environ, "DEEPOFFLOAD_BUILD_AIO": "1", "CXX": "deepoffload-no-such-compiler"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "cannot be built here" in proc.stdout + proc.stderr
    assert not list((tmp_path / "dist").glob("*.whl")) if (tmp_path / "dist").exists() else True
