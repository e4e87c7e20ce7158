"""The command line over several drives: ``report`` lists each folder's filesystem, device and O_DIRECT support and
flags folders on one device; ``bench --folder A --folder B`` measures each drive alone and all together; ``tune``
writes each drive's speed as ``folder_speeds``; ``plan --folder`` shows where each block goes, as the layout places
it. Drives are loop-device filesystems (``tests/support/drives.py``: root only, skipped with the reason elsewhere)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from deepoffload import SwapConfig, offload_parameters
from deepoffload.cli.main import main
from tests.support.drives import Drives, unavailable


@pytest.fixture
def two():
    reason = unavailable("loop")
    if reason is not None:
        pytest.skip(reason)
    with Drives(2, size=32 << 20) as drives:
        yield drives.folders


def test_report_lists_each_folder_and_flags_one_device_twice(two, tmp_path, capsys):
    same = tmp_path / "same"
    same.mkdir()
    assert main(["report", "--json", "--folder", two[0], "--folder", two[1], "--folder", str(tmp_path)]) == 0
    folders = json.loads(capsys.readouterr().out)["folders"]
    assert [f["path"] for f in folders] == [two[0], two[1], str(tmp_path)]
    assert all(f["filesystem"] == "ext4" and f["direct_io"] is True for f in folders[:2])
    assert len({f["device"] for f in folders}) == 3 and [f["drive"] for f in folders] == [0, 1, 2]
    assert main(["report", "--folder", two[0], "--folder", str(tmp_path), "--folder", str(same)]) == 0
    out = capsys.readouterr().out
    assert "swap folder" in out and f"same device as {tmp_path}" in out
    assert main(["report", "--folder", two[0], "--folder", str(tmp_path / "missing")]) == 1


def test_bench_measures_each_drive_and_all_together(two, capsys):
    assert main(["bench", "--folder", two[0], "--folder", two[1], "--size", "4M", "--loops", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for op in ("write", "read"):
        entry = report["results"][op]
        assert [d["folder"] for d in entry["drives"]] == two and all(len(d["gbps"]) == 2 for d in entry["drives"])
        assert len(entry["together"]["gbps"]) == 2 and entry["together"]["of_sum"] > 0
    assert main(["bench", "--folder", two[0], "--folder", two[1], "--size", "4M", "--loops", "1"]) == 0
    assert "together (all drives)" in capsys.readouterr().out


def test_tune_writes_each_drives_speed_for_the_swap_config(two, tmp_path, capsys):
    output = tmp_path / "swap.json"
    args = ["tune", "--folder", two[0], "--folder", two[1], "--size", "4M", "--budget", "2", "--output", str(output)]
    assert main(args) == 0
    config = SwapConfig.from_json(output)
    assert config.folder == tuple(two) and config.layout == "drives" and len(config.folder_speeds) == 2
    assert "together (all drives)" in capsys.readouterr().out


def test_plan_shows_where_each_block_goes_as_the_layout_places_it(two, tmp_path, capsys):
    from safetensors.torch import save_file

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(5)])
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    argv = ["plan", str(tmp_path / "model.safetensors"), "--max-memory", "64GB", "--folder", two[0], "--folder"]
    assert main([*argv, two[1], "--folder-speeds", "2,1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  drive ")]
    assert "share 0.67" in rows[0] and rows[0].endswith("  0, 2, 3") and rows[1].endswith("  1, 4")
    config = SwapConfig(folder=two, folder_speeds=(2.0, 1.0), pin=False)
    with offload_parameters(model, config=config):  # where the layout really puts them
        files = [
            sorted(n for r in os.listdir(f) for n in os.listdir(os.path.join(f, r)) if n.endswith(".swp")) for f in two
        ]
    assert files == [["block0.swp", "block2.swp", "block3.swp"], ["block1.swp", "block4.swp"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*argv, str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
