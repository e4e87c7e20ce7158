"""Every save path killed (SIGKILL, no cleanup) just before each rename, fsync, unlink and op write it makes, and at
random times: the checkpoint then loads entirely old or entirely new, and the next save leaves the folder exactly as
a clean save does (no temporaries, no shards or swap folders of the dead writer). See ``runner.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .scenarios import SCENARIOS

RUNNER = Path(__file__).with_name("runner.py")


def kill_everywhere(base: Path, scenarios: list[str], points, random: int, timeout: int) -> list[dict]:
    request = {"scenarios": scenarios, "base": str(base), "points": points, "random": random, "seed": 27}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(RUNNER), json.dumps(request)], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {r["scenario"] for r in results} == set(scenarios), done.stderr[-4000:]
    return results


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
