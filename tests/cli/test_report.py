"""``deepoffload report``: the ops table, probes with reasons and hints, versions, --path, --json, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepoffload import diagnostics
from deepoffload.cli import report
from deepoffload.cli.main import main
from tests.conftest import without_prebuilt_op


def run_report(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepoffload", "report", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_json_report_describes_the_op(aio, scratch):
    proc = run_report("--json", "--path", str(scratch))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    op = data["ops"][0]
    assert op["name"] == "async_io" and op["compatible"] is True
    assert set(op["probes"]) == {"cxx", "libaio", "io_pgetevents", "liburing"}
    assert op["probes"]["cxx"]["status"] == "ok"
    assert op["built"], "the session fixture built the op, so the report finds it"
    assert "posix" in op["engines"] and op["engines"]["posix"]["ok"]
    assert op["auto_engine"] in op["engines"]
    for key in ("deepoffload", "torch", "python", "compiler", "kernel", "cache_dir", "libaio", "liburing"):
        assert key in data["versions"]
    path = data["path"]
    assert path["free_bytes"] > 0 and path["filesystem"] != "unknown"
    assert path["direct_io"] is True and path["alignment"] in (512, 1024, 2048, 4096)


def test_text_report_has_table_and_no_colour_when_piped(aio):
    proc = run_report()
    assert proc.returncode == 0
    assert "op" in proc.stdout and "async_io" in proc.stdout and "compatible" in proc.stdout
    assert "\033[" not in proc.stdout, "no colour codes when stdout is not a terminal"
    assert "engine 'auto' selects" in proc.stdout


def test_colour_only_on_a_terminal_and_no_color_respected():
    data = {
        "versions": {"x": "1"},
        "ops": [
            {
                "name": "async_io",
                "installed": False,
                "compatible": True,
                "engines_buildable": ["posix"],
                "built": None,
                "engines": {},
                "auto_engine": None,
                "probes": {
                    "liburing": {
                        "status": "missing",
                        "reason": "fatal error: liburing.h: No such file",
                        "output_tail": [],
                        "hint": "apt-get install liburing-dev",
                    }
                },
            }
        ],
    }
    coloured = report.render(data, report.Style(True))
    plain = report.render(data, report.Style(False))
    assert "\033[31m" in coloured and "\033[" not in plain
    assert "liburing.h: No such file" in plain and "apt-get install liburing-dev" in plain


@without_prebuilt_op
def test_missing_pieces_show_reason_and_hint(tmp_path):
    sysroot = tmp_path / "empty"
    sysroot.mkdir()
    proc = run_report(
        "--json", env={"CFLAGS": f"--sysroot={sysroot}", "DEEPOFFLOAD_CACHE_DIR": str(tmp_path / "cache")}
    )
    data = json.loads(proc.stdout)
    probe = data["ops"][0]["probes"]["libaio"]
    assert probe["status"] == "missing" and probe["reason"] and "libaio" in probe["hint"]
    assert data["ops"][0]["built"] is None


@without_prebuilt_op
def test_exit_status_is_nonzero_when_the_op_cannot_be_used(tmp_path):
    proc = run_report(env={"CXX": "deepoffload-no-such-compiler", "DEEPOFFLOAD_CACHE_DIR": str(tmp_path / "c")})
    assert proc.returncode == 1
    assert "missing" in proc.stdout and "not found" in proc.stdout


def test_warm_report_compiles_nothing(aio, monkeypatch):
    from deepoffload.op_builder import probes

    diagnostics.gather()  # warm the probe cache
    monkeypatch.setattr(probes, "run_probe", lambda *a, **k: pytest.fail("the warm report ran a probe"))
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda *a, **k: pytest.fail("the report built the op"))
    data = diagnostics.gather()
    assert data["ops"][0]["compatible"]


@pytest.mark.parametrize("kind", ["file", "missing"])
def test_path_that_is_not_a_folder_fails(tmp_path, capsys, kind):
    path = tmp_path / kind
    if kind == "file":
        path.write_text("x")
    assert main(["report", "--path", str(path)]) == 1
    assert "not an existing folder" in capsys.readouterr().out


@pytest.mark.parametrize("folder", ["/proc", "/sys"])
def test_path_on_a_virtual_filesystem_fails_without_a_traceback(capsys, folder):
    if not os.path.isdir(folder):
        pytest.skip(f"no {folder} here")
    assert main(["report", "--path", folder]) == 1
    out = capsys.readouterr().out
    assert f"{folder}: not a folder deepoffload can use" in out and "cannot create a file there" in out


def test_usable_path_passes(aio, scratch, capsys):
    assert main(["report", "--path", str(scratch)]) == 0
    assert "O_DIRECT" in capsys.readouterr().out


@without_prebuilt_op
@pytest.mark.parametrize("built", [False, True])
def test_report_does_not_import_torch(aio, tmp_path, built):
    """torch takes over a second to import; the report loads the built op without it and never builds."""
    code = (
        "import sys; from deepoffload import diagnostics; d = diagnostics.gather(); "
        "print('torch' in sys.modules, bool(d['ops'][0]['engines']))"
    )
    cache = os.environ["DEEPOFFLOAD_CACHE_DIR"] if built else str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DEEPOFFLOAD_CACHE_DIR": cache},
    )
    assert proc.stdout.split() == ["False", str(built)], proc.stderr


def test_the_report_lists_the_registered_layouts_and_codecs_from_their_registries(monkeypatch):
    from deepoffload.cli.report import extension_rows
    from deepoffload.swap.codecs import ByteCodec, codec_names, register_codec, unregister_codec
    from deepoffload.swap.layouts import layout_names

    rows = extension_rows()
    assert [r["name"] for r in rows if r["kind"] == "storage layout"] == layout_names()
    assert [r["name"] for r in rows if r["kind"] == "byte codec"] == codec_names()
    assert all(r["description"] for r in rows), "every built-in says what it is"

    @register_codec("report-toy")
    class Toy(ByteCodec):
        description = "a codec registered by this test"

    try:
        assert {"kind": "byte codec", "name": "report-toy", "description": Toy.description} in extension_rows()
    finally:
        unregister_codec("report-toy")
