"""Every save path killed (SIGKILL, no cleanup) just before each rename, fsync, unlink and op write it makes, and at
random times: the checkpoint then loads entirely old or entirely new, and the next save leaves the folder exactly as
a clean save does (no temporaries, no shards or swap folders of the dead writer). See ``runner.py``.

And two saves into one folder that overlap: one paused just before each of those steps while the other runs to its
end; the folder loads entirely as one of the checkpoints throughout, and once both end as the one whose switch came
last, with nothing left behind. See ``two_writers.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deepoffload
from tests.support.drives import Drives, unavailable

from .scenarios import SCENARIOS, SECOND_DRIVE

RUNNER = Path(__file__).with_name("runner.py")
TWO_WRITERS = Path(__file__).with_name("two_writers.py")
OVERLAPPING = ["save_sharded", "offload_save_sharded", "save", "dcp"]  # sharded safetensors, off.save, save, DCP


@pytest.fixture(autouse=True)
def second_drive(monkeypatch):
    """The ``two_drives`` scenario's second swap folder, on a device of its own (a tmpfs) where one can be mounted;
    the harness lists it with the work folder, so a dead run's folder left there counts as left behind."""
    if unavailable("tmpfs") is not None:
        yield
        return
    with Drives(1, size=64 << 20, kind="tmpfs") as drive:
        monkeypatch.setenv(SECOND_DRIVE, drive.folders[0])
        yield


def child_env() -> dict[str, str]:
    """The environment of a harness process: one thread, and the deepoffload these tests import (the script's own
    folder comes first on its path, so an editable install elsewhere would otherwise win)."""
    root = str(Path(deepoffload.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)


def harness(script: Path, request: dict, timeout: int) -> list[dict]:
    """Run a harness script on ``request`` in a fresh process; its JSON lines, one per scenario at least."""
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {r["scenario"] for r in results} == set(request["scenarios"]), done.stderr[-4000:]
    return results


def kill_everywhere(base: Path, scenarios: list[str], points, random: int, timeout: int) -> list[dict]:
    request = {"scenarios": scenarios, "base": str(base), "points": points, "random": random, "seed": 27}
    return harness(RUNNER, request, timeout)


def check(results: list[dict]) -> None:
    for r in results:
        where = f"{r['scenario']} killed {r['kind']} {r['at']} (of {r['total']} boundaries)"
        if r["kind"] == "point":
            assert r["killed"], f"{where}: was not killed"
        assert r["after_kill"] in ("old", "new"), f"{where}: the checkpoint is {r['after_kill']}"
        assert r["after_next"] == "new", f"{where}: after the next save the checkpoint is {r['after_next']}"
        assert r["left_behind"] == [] and r["missing"] == [], f"{where}: after the next save: {r}"


def test_a_kill_in_the_middle_of_every_save_path(scratch):
    check(kill_everywhere(scratch, list(SCENARIOS), 1, 0, timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_kill_point_of(scenario, scratch):
    results = kill_everywhere(scratch, [scenario], "all", 1, timeout=900)
    check(results)
    assert {r["after_kill"] for r in results} == {"old", "new"}, "the kills span the switch from old to new"


def overlap_everywhere(base: Path, scenarios: list[str], points, timeout: int) -> list[dict]:
    return harness(TWO_WRITERS, {"scenarios": scenarios, "base": str(base), "points": points}, timeout)


def check_overlaps(results: list[dict]) -> None:
    for r in results:
        where = f"{r['scenario']}: save B paused before its boundary {r['at']} (of {r['total']}) while save A ran"
        assert r["paused"], f"{where}: B ended before it"
        assert (r["b_exit"], r["a_exit"]) == (0, 0), f"{where}: a save failed: {r}"
        assert r["middle"] in ("v1", "v2", "v3"), f"{where}: meanwhile the checkpoint is {r['middle']}"
        assert r["last_switch"] in ("v2", "v3"), f"{where}: switches {r['switches']}"
        assert r["end"] == r["last_switch"], f"{where}: at the end the checkpoint is {r['end']}, not {r['last_switch']}"
        assert r["left_behind"] == [] and r["missing"] == [], f"{where}: at the end: {r}"


def test_a_save_paused_while_another_saves_into_the_folder(scratch):
    check_overlaps(overlap_everywhere(scratch, OVERLAPPING, 3, timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("scenario", OVERLAPPING)
def test_a_save_paused_at_every_step_while_another_saves_into_the_folder(scenario, scratch):
    results = overlap_everywhere(scratch, [scenario], "all", timeout=900)
    check_overlaps(results)
    assert {r["last_switch"] for r in results} == {"v2", "v3"}, "the pauses span the paused save's switch"
    # the single file is switched by one rename and takes no lock; the folders' switches take turns
    assert any(r["a_waited"] for r in results) == (scenario != "save")
