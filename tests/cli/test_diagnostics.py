"""The torch-free diagnostics (facts about a folder and the op, as data) and the report's rendering of such data,
each tested on its own: rendering from a hand-written report, gathering without rendering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepoffload import diagnostics
from deepoffload.cli import report


def test_direct_io_of_a_folder_is_one_probe_for_report_bench_and_tune(tmp_path):
    result = diagnostics.direct_io(tmp_path)
    if result.works:
        assert result.alignment in (512, 1024, 2048, 4096) and result.reason == ""
    else:
        assert result.alignment is None and result.reason
    (tmp_path / "file").write_bytes(b"x")
    assert diagnostics.direct_io_works(tmp_path / "file") == diagnostics.direct_io_works(tmp_path) == result.works
    status = diagnostics.path_status(str(tmp_path))
    assert (status["direct_io"], status["alignment"]) == (result.works, result.alignment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"], "the probe leaves no file behind"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_folder_that_takes_no_files_says_so():
    result = diagnostics.direct_io(Path("/proc/self"))
    assert not result.works and result.reason.startswith(diagnostics.CANNOT_CREATE)


def test_filesystem_is_the_longest_mount_containing_the_path(tmp_path):
    fstype, mount = diagnostics.filesystem(tmp_path)
    assert fstype and (str(tmp_path.resolve()) + "/").startswith(mount.rstrip("/") + "/")


def test_gathering_gives_json_data_without_importing_torch(tmp_path):
    code = (
        "import json, sys; from deepoffload import diagnostics; "
        f"d = diagnostics.gather({str(tmp_path)!r}); json.dumps(d); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


SAMPLE = {
    "versions": {"deepoffload": "9.9", "torch": "2.x", "libaio": None},
    "ops": [
        {
            "name": "async_io",
            "installed": False,
            "compatible": True,
            "engines_buildable": ["libaio", "posix"],
            "built": "/cache/build/async_io-1",
            "auto_engine": "posix",
            "engines": {"libaio": {"ok": False, "reason": "io_setup: EAGAIN"}, "posix": {"ok": True, "reason": ""}},
            "probes": {
                "cxx": {"status": "ok", "reason": "", "output_tail": [], "hint": ""},
                "liburing": {
                    "status": "missing",
                    "reason": "liburing.h: No such file",
                    "output_tail": [],
                    "hint": "apt-get install liburing-dev",
                },
            },
        }
    ],
    "path": {
        "path": "/data",
        "free_bytes": 5_000_000_000,
        "total_bytes": 10_000_000_000,
        "filesystem": "xfs",
        "mount": "/data",
        "writable": True,
        "direct_io": True,
        "alignment": 4096,
        "direct_io_reason": "",
    },
}


def test_rendering_shows_every_fact_of_the_data():
    text = report.render(json.loads(json.dumps(SAMPLE)), report.Style(False))
    for fact in (
        "libaio (fails self-test)",
        "posix",
        "yes (cache)",
        "liburing: apt-get install liburing-dev",
        "engine 'auto' selects: posix",
        "libaio self-test failed: io_setup: EAGAIN",
        "xfs (mounted at /data)",
        "5.0 GB of 10.0 GB",
        "yes, alignment 4096 bytes",
        "9.9",
    ):
        assert fact in text, fact
    assert "\033[" not in text
    assert report.usable(SAMPLE)
    broken = {**SAMPLE, "path": {"path": "/proc", "error": "not a folder deepoffload can use"}}
    assert "/proc: not a folder deepoffload can use" in report.render(broken, report.Style(False))


@pytest.mark.parametrize("library", ["libdeflate", "zlib"])
def test_the_report_names_the_library_computing_the_save_crcs(library, monkeypatch):
    from deepoffload.io import crc
    from op_builder.async_io import AsyncIOBuilder

    monkeypatch.setattr(crc, "backend", lambda: library)
    shown = diagnostics.versions(AsyncIOBuilder())["save_crc"]
    if library == "libdeflate":
        assert shown == "libdeflate"
    else:
        assert shown.startswith("zlib") and "libdeflate0" in shown, shown
