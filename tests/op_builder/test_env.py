"""One table per fact: every environment variable is read through ``op_builder.env`` with one parser, and every
list of engines (compile flags, config, command line, report) derives from ``op_builder.async_io.ENGINES``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deepoffload.op_builder import env
from deepoffload.op_builder.async_io import ENGINE_NAMES, ENGINES, AsyncIOBuilder
from deepoffload.op_builder.probes import ProbeResult

ROOT = Path(__file__).resolve().parents[2]
# reads of os.environ that are not settings: builder.py saves and restores CXX around torch's build, probes pass the
# whole environment to the compiler they run, deepspeed_children sets DEEPOFFLOAD_DEEPSPEED for child processes and
# restores it (its one reader is the line of the installed .pth, which cannot import anything first)
NOT_SETTINGS = {
    "op_builder/builder.py",
    "op_builder/probes.py",
    "deepoffload/integrations/deepspeed_children.py",
    "deepoffload/integrations/deepspeed_env.py",
}


def environ_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read a variable from ``os.environ`` or ``os.getenv``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "getenv":
            lines.append(node.lineno)
        if isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
    return lines


def test_only_the_env_module_reads_the_environment():
    files = [ROOT / "setup.py", *(ROOT / "op_builder").rglob("*.py"), *(ROOT / "deepoffload").rglob("*.py")]
    offenders = {}
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in NOT_SETTINGS or rel == "op_builder/env.py":
            continue
        lines = environ_reads(path)
        if lines:
            offenders[rel] = lines
    assert offenders == {}


@pytest.mark.parametrize(
    "text,value",
    [
        ("1", True),
        ("true", True),
        (" Yes ", True),
        ("ON", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
    ],
)
def test_one_flag_parser(text, value):
    assert env.parse("X", "flag", text) is value


def test_bad_values_name_the_variable_and_what_is_accepted(monkeypatch):
    monkeypatch.setenv("DEEPOFFLOAD_BUILD_AIO", "maybe")
    with pytest.raises(env.EnvError, match=r"DEEPOFFLOAD_BUILD_AIO='maybe': expected 1/0/true/false"):
        env.get("DEEPOFFLOAD_BUILD_AIO")
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(env.EnvError, match=r"RANK='two': expected an integer"):
        env.get("RANK")


def test_values_defaults_and_paths(monkeypatch, tmp_path):
    for name in ("RANK", "DEEPOFFLOAD_CACHE_DIR", "DEEPOFFLOAD_SANITIZE"):
        monkeypatch.delenv(name, raising=False)
    assert (env.get("RANK"), env.get("DEEPOFFLOAD_CACHE_DIR"), env.get("DEEPOFFLOAD_SANITIZE")) == (0, None, "")
    monkeypatch.setenv("RANK", "07")
    monkeypatch.setenv("DEEPOFFLOAD_CACHE_DIR", str(tmp_path))
    assert (env.get("RANK"), env.get("DEEPOFFLOAD_CACHE_DIR")) == (7, tmp_path)
    assert env.parse("DEEPOFFLOAD_AIO_BLOCK_SIZE", "int", "0x1000") == 4096
    with pytest.raises(KeyError, match="NOT_A_VARIABLE"):
        env.get("NOT_A_VARIABLE")


def test_setup_py_refuses_a_flag_it_cannot_parse():
    proc = subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "DEEPOFFLOAD_BUILD_AIO": "maybe"},
        timeout=120,
    )
    assert proc.returncode != 0 and "DEEPOFFLOAD_BUILD_AIO='maybe'" in proc.stderr


def test_every_engine_list_derives_from_the_table():
    from deepoffload.cli.main import build_parser
    from deepoffload.io.engines import choices

    CONFIG_ENGINES = choices()

    assert ENGINE_NAMES == ("io_uring", "libaio", "posix", "windows")
    assert CONFIG_ENGINES == ("auto", *ENGINE_NAMES)
    parser = build_parser()
    for engine in CONFIG_ENGINES:  # "windows" included, which the bench command lacked
        assert parser.parse_args(["bench", "--path", "/tmp", "--engine", engine]).engine == engine


def test_flags_and_engines_follow_the_probes():
    builder = AsyncIOBuilder(platform="linux")
    probes = {row.probe.name for row in ENGINES if row.probe is not None}
    everything = {name: ProbeResult(name, True) for name in ["cxx", *probes]}
    cflags, ldflags = builder.feature_flags(everything)
    assert cflags == [f"-D{row.define}=1" for row in ENGINES if row.define]
    assert [f for f in ldflags if f.startswith("-l")] == [f"-l{row.library}" for row in ENGINES if row.library]
    assert builder.engines(everything) == ["io_uring", "libaio", "posix"]
    no_libaio = {**everything, "libaio": ProbeResult("libaio", False, "missing")}
    cflags, _ = builder.feature_flags(no_libaio)
    assert cflags == ["-DDEEPOFFLOAD_HAVE_URING=1"], "io_pgetevents is a feature of libaio, not compiled without it"


def test_the_built_op_has_only_engines_of_the_table():
    from deepoffload.io.native import native

    assert set(native().engines()) <= set(ENGINE_NAMES)
    assert (native().TRUNCATE, native().FSYNC) != (0, 0)
