"""``deepoffload bench`` and the measuring library under it: sizes, JSON fields and units, fio comparison (with a
fake fio on PATH that records how it was called), baselines, and every error: a clear line and a non-zero exit, with
the test file removed."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from deepoffload.bench.fio import fio_command, parse_fio_json
from deepoffload.bench.measure import BenchError
from deepoffload.bench.sizes import format_size, parse_size
from deepoffload.cli.main import main

FAKE_FIO = r"""#!{python}
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
with open(os.environ["FAKE_FIO_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
if os.environ.get("FAKE_FIO_FAIL"):
    print("fio: something went wrong", file=sys.stderr)
    sys.exit(1)
bw = float(os.environ["FAKE_FIO_BW"])
job = {{"jobname": args["name"], "read": {{"bw_bytes": 0, "io_bytes": 0}}, "write": {{"bw_bytes": 0, "io_bytes": 0}}}}
job[args["rw"]] = {{"bw_bytes": bw, "io_bytes": int(args["size"]) * int(args["numjobs"])}}
print("note: both iodepth >= 1 and synchronous I/O engine are selected")  # fio prints warnings before the JSON
print(json.dumps({{"fio version": "fio-3.33", "jobs": [job]}}, indent=2))
"""


@pytest.fixture
def fake_fio(tmp_path, monkeypatch):
    """A fake ``fio`` first on PATH; returns the list of argument dicts it was called with (read after the run)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "fio"
    script.write_text(FAKE_FIO.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "fio-calls.jsonl"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_FIO_LOG", str(log))
    monkeypatch.setenv("FAKE_FIO_BW", "1.25e9")
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def bench_json(capsys, folder, *extra) -> dict:
    code = main(["bench", "--path", str(folder), "--size", "4M", "--loops", "2", "--json", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def error_line(capsys, argv) -> str:
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 1
    assert len(err) == 1, err
    return err[0]


# -- sizes ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,nbytes",
    [
        ("4096", 4096),
        ("512K", 512 << 10),
        ("1m", 1 << 20),
        ("1G", 1 << 30),
        ("2GiB", 2 << 30),
        (" 3 MB ", 3 << 20),
        ("1T", 1 << 40),
    ],
)
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "0", "1.5G", "-1M", "1X", "G", "1 G B"])
def test_parse_size_rejects_with_what_is_accepted(text):
    with pytest.raises(ValueError, match="K, M, G|at least 1 byte"):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (1 << 30, 384 << 10, 1_000_003)] == ["1 GiB", "384 KiB", "1000003 B"]


def test_bad_size_is_a_usage_error(scratch, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--path", str(scratch), "--size", "lots"])
    assert exc.value.code == 2
    assert "K, M, G" in capsys.readouterr().err


# -- measuring -----------------------------------------------------------------------------------------------------
def test_json_fields_units_and_consistency(aio, scratch, capsys):
    report = bench_json(capsys, scratch, "--block-size", "1M", "--threads", "2", "--queue-depth", "8")
    assert report["units"]["throughput"] == "GB/s (1e9 bytes per second)"
    assert report["file_bytes"] == 4 << 20 and report["loops"] == 2 and report["buffer"] == "pinned"
    assert report["direct_io"] is True
    config = report["config"]
    assert (config["block_size"], config["queue_depth"], config["intra_op_parallelism"]) == (1 << 20, 8, 2)
    assert config["engine"] in aio.engines()
    assert list(report["results"]) == ["write", "read"]
    for op in ("write", "read"):
        ours = report["results"][op]["deepoffload"]
        assert len(ours["gbps"]) == len(ours["seconds_per_transfer"]) == 2
        for gbps, seconds in zip(ours["gbps"], ours["seconds_per_transfer"]):
            assert gbps == pytest.approx((4 << 20) / seconds / 1e9)
        assert ours["median_gbps"] == pytest.approx(statistics.median(ours["gbps"]))
        assert ours["requests_per_transfer"] == 4
        assert ours["median_seconds_per_request"] == pytest.approx(ours["median_seconds_per_transfer"] / 4)
        assert set(report["results"][op]) == {"deepoffload"}
    assert list(scratch.iterdir()) == []


def test_table_output_labels_units(aio, scratch, capsys):
    code = main(["bench", "--path", str(scratch), "--size", "2M", "--loops", "2", "--read"])
    out = capsys.readouterr().out
    assert code == 0
    assert "GB/s (1e9 bytes/s)" in out and "median" in out and "per request" in out
    assert "\nread" in out and "\nwrite" not in out
    assert list(scratch.iterdir()) == []


def test_unaligned_buffer_and_odd_size(aio, scratch, capsys):
    code = main(
        [
            "bench",
            "--path",
            str(scratch),
            "--size",
            "1000003",
            "--block-size",
            "256K",
            "--loops",
            "1",
            "--buffer",
            "unaligned",
            "--json",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["buffer"] == "unaligned" and report["file_bytes"] == 1_000_003
    assert report["results"]["read"]["deepoffload"]["requests_per_transfer"] == 4


def test_config_file_is_the_base_and_flags_override(aio, scratch, tmp_path, capsys):
    path = tmp_path / "aio.json"
    path.write_text(json.dumps({"block_size": 262144, "queue_depth": 4, "engine": "posix"}))
    report = bench_json(capsys, scratch, "--config", str(path), "--queue-depth", "16", "--write")
    assert report["config"]["block_size"] == 262144 and report["config"]["queue_depth"] == 16
    assert report["config"]["engine"] == "posix"
    assert list(report["results"]) == ["write"]


def test_baselines_side_by_side(aio, scratch, capsys):
    report = bench_json(capsys, scratch, "--baselines")
    write, read = report["results"]["write"], report["results"]["read"]
    assert {"deepoffload", "mmap", "torch.save", "ratio_vs_mmap", "ratio_vs_torch.save"} == set(write)
    assert {"deepoffload", "mmap", "torch.load", "ratio_vs_mmap", "ratio_vs_torch.load"} == set(read)
    for entry, other in ((write, "torch.save"), (read, "mmap")):
        expected = [a / b for a, b in zip(entry["deepoffload"]["gbps"], entry[other]["gbps"])]
        assert entry[f"ratio_vs_{other}"]["per_loop"] == pytest.approx(expected)
    assert list(scratch.iterdir()) == []


# -- fio -----------------------------------------------------------------------------------------------------------
def test_compare_fio_ratio_and_same_settings(aio, scratch, capsys, fake_fio):
    report = bench_json(capsys, scratch, "--compare-fio", "--block-size", "1M", "--queue-depth", "16", "--threads", "2")
    for op in ("write", "read"):
        entry = report["results"][op]
        assert entry["fio"]["gbps"] == pytest.approx([1.25, 1.25])
        expected = [g / 1.25 for g in entry["deepoffload"]["gbps"]]
        assert entry["ratio_vs_fio"]["per_loop"] == pytest.approx(expected)
        assert entry["ratio_vs_fio"]["median"] == pytest.approx(statistics.median(expected))
    calls = fake_fio()
    assert [c["rw"] for c in calls] == ["write", "read", "write", "read"]  # interleaved with ours, loop by loop
    files = {c["filename"] for c in calls}
    assert len(files) == 1 and Path(files.pop()).parent == scratch
    for call in calls:
        assert (call["bs"], call["iodepth"], call["direct"], call["ioengine"], call["numjobs"]) == (
            "1048576",
            "16",
            "1",
            "libaio",
            "2",
        )
        assert int(call["size"]) * 2 == 4 << 20 and call["offset_increment"] == call["size"]
        assert call["output-format"] == "json"
    assert list(scratch.iterdir()) == []


def test_fio_missing_says_how_to_get_it(aio, scratch, capsys, tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    line = error_line(capsys, ["bench", "--path", str(scratch), "--size", "1M", "--compare-fio"])
    assert "apt-get install fio" in line
    assert list(scratch.iterdir()) == []


def test_fio_failure_is_one_line_and_file_removed(aio, scratch, capsys, fake_fio, monkeypatch):
    monkeypatch.setenv("FAKE_FIO_FAIL", "1")
    line = error_line(capsys, ["bench", "--path", str(scratch), "--size", "1M", "--compare-fio"])
    assert "fio failed (exit 1): fio: something went wrong" in line
    assert len(fake_fio()) == 1
    assert list(scratch.iterdir()) == []


def test_compare_fio_needs_direct_io(aio, scratch, capsys, fake_fio, monkeypatch):
    import deepoffload.bench.runner as runner

    monkeypatch.setattr(runner, "direct_io_works", lambda path: False)
    line = error_line(capsys, ["bench", "--path", str(scratch), "--size", "1M", "--compare-fio"])
    assert "refuses O_DIRECT" in line and "--compare-fio" in line
    assert fake_fio() == [] and list(scratch.iterdir()) == []


@pytest.mark.parametrize("text", ["", "not json", '{"jobs": []}', '{"jobs": [{"read": {}}]}'])
def test_parse_fio_json_rejects_malformed(text):
    with pytest.raises(BenchError, match="fio's read throughput"):
        parse_fio_json(text, "read")


def test_parse_fio_json_rejects_zero_throughput():
    with pytest.raises(BenchError, match="no write throughput"):
        parse_fio_json(json.dumps({"jobs": [{"write": {"bw_bytes": 0}}]}), "write")


def test_fio_jobs_take_whole_blocks(tmp_path):
    argv, moved = fio_command("fio", tmp_path / "f", "read", 10 << 20, 1 << 20, 32, 3)
    assert "--size=3145728" in argv and "--offset_increment=3145728" in argv and moved == 9 << 20
    with pytest.raises(BenchError, match="too small"):
        fio_command("fio", tmp_path / "f", "read", 1 << 20, 1 << 20, 32, 2)


# -- folder errors -------------------------------------------------------------------------------------------------
@pytest.fixture
def unwritable_folder(tmp_path):
    """A folder nobody, root included, can create files in: mode 0500 for a normal user; as root (who ignores
    permissions) a read-only tmpfs mount, else an immutable folder (chattr +i)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o500)
        yield folder
        folder.chmod(0o700)
        return
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1M", "tmpfs", str(folder)], capture_output=True
        ).returncode
        == 0
    ):
        yield folder
        subprocess.run(["umount", str(folder)], check=True)
        return
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        yield folder
        subprocess.run(["chattr", "-i", str(folder)], check=True)
        return
    pytest.skip("root, and neither a read-only tmpfs mount nor chattr +i works here")


def test_unwritable_folder(aio, unwritable_folder, capsys):
    line = error_line(capsys, ["bench", "--path", str(unwritable_folder), "--size", "4K"])
    assert "cannot create a test file in" in line and "--path" in line
    assert list(unwritable_folder.iterdir()) == []


def test_path_is_not_a_folder(scratch, capsys):
    a_file = scratch / "file"
    a_file.write_bytes(b"x")
    line = error_line(capsys, ["bench", "--path", str(a_file), "--size", "4K"])
    assert "is not an existing folder" in line
    line = error_line(capsys, ["bench", "--path", str(a_file / "sub"), "--size", "4K"])
    assert "is not an existing folder" in line


def test_not_enough_space_checked_before_writing(scratch, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 20, 9 << 20, 1 << 20))
    line = error_line(capsys, ["bench", "--path", str(scratch), "--size", "2M"])
    assert "not enough free space" in line and "2097152 bytes" in line and "1048576 are free" in line
    assert list(scratch.iterdir()) == []


@pytest.mark.root
def test_too_small_filesystem(small_fs, capsys):
    folder = small_fs(1 << 20, "tmpfs")
    line = error_line(capsys, ["bench", "--path", str(folder), "--size", "4M"])
    assert "not enough free space" in line
    assert list(folder.iterdir()) == []


def test_virtual_filesystem_is_named_as_such_not_full(capsys):
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    line = error_line(capsys, ["bench", "--path", "/proc", "--size", "4K"])
    assert "cannot create a test file in /proc" in line and "virtual filesystem" in line
    assert "free space" not in line


@pytest.mark.parametrize("option", ["--queue-depth", "--threads", "--loops"])
@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_counts_must_be_positive(scratch, capsys, option, value):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--path", str(scratch), "--size", "4K", option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be a positive integer" in err and "bytes/count" not in err
