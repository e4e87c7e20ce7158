"""``deepoffload tune``: the guided search (on a fake clock and fake measurements, so its budget and its choices are
exact) and the command end to end on a real folder, whose output must load into ``AioConfig`` unchanged."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time

import pytest
import torch  # noqa: F401  (imported here so the budget test times the search, not this import)

from deepoffload.bench.search import Knob, Search, combined_score, default_knobs
from deepoffload.cli.main import main
from deepoffload.config import AioConfig

START = AioConfig(engine="io_uring")
ENGINES = ("io_uring", "libaio", "posix")
KNOBS = default_knobs(ENGINES, 1 << 30)


class FakeDisk:
    """Measurements from a formula with one peak, each taking ``seconds`` on a fake clock."""

    def __init__(self, seconds: float = 1.0, lucky: AioConfig | None = None):
        self.now = 0.0
        self.seconds = seconds
        self.lucky = lucky
        self.calls: list[AioConfig] = []

    def clock(self) -> float:
        return self.now

    def measure(self, config: AioConfig) -> tuple[float, float]:
        self.now += self.seconds
        self.calls.append(config)
        if config == self.lucky and self.calls.count(config) == 1:
            return 100.0, 100.0  # one lucky measurement, then the truth
        penalty = (
            (math.log2(config.block_size) - 18) ** 2
            + (math.log2(config.queue_depth) - 3) ** 2
            + (config.intra_op_parallelism - 2) ** 2
            + config.single_submit
            + (not config.overlap_events)
            + (config.engine != "libaio")
        )
        return 4.0 / (1 + penalty), 2.0 / (1 + penalty)


def search(disk: FakeDisk, budget: float, **kwargs) -> Search:
    return Search(disk.measure, START, KNOBS, budget, clock=disk.clock, **kwargs)


def test_finds_the_peak_without_a_grid():
    disk = FakeDisk()
    result = search(disk, budget=1000).run()
    assert result.best == AioConfig(block_size=256 << 10, queue_depth=8, intra_op_parallelism=2, engine="libaio")
    assert result.stopped == "converged"
    assert (result.best_write_gbps, result.best_read_gbps) == (4.0, 2.0)
    assert result.best_score == pytest.approx(combined_score(4.0, 2.0)) == pytest.approx(8 / 3)
    grid = math.prod(len(k.values) for k in KNOBS)
    assert len(result.trials) < grid / 20
    assert sum(t.config == result.best for t in result.trials) == 5  # the leaders were measured again


def test_stops_starting_trials_that_would_overrun_the_budget():
    disk = FakeDisk(seconds=1.0)
    result = search(disk, budget=7.5).run()
    assert len(result.trials) == 7 and result.elapsed_s == 7.0 <= 7.5
    assert result.stopped == "budget"


def test_search_share_leaves_time_for_repeats():
    disk = FakeDisk(seconds=1.0)
    result = search(disk, budget=10, search_share=0.5).run()
    phases = [t.phase for t in result.trials]
    assert phases == ["search"] * 5 + ["repeat"] * 5


def test_first_trial_runs_even_when_the_budget_is_shorter():
    disk = FakeDisk(seconds=5.0)
    result = search(disk, budget=1).run()
    assert len(result.trials) == 1 and result.best == START and result.stopped == "budget"


def test_setup_time_counts_against_the_budget():
    disk = FakeDisk(seconds=1.0)
    disk.now = 4.0
    result = Search(disk.measure, START, KNOBS, 7.5, clock=disk.clock, started=0.0).run()
    assert len(result.trials) == 3 and result.elapsed_s == 7.0


def test_a_lucky_measurement_does_not_win():
    lucky = dataclasses.replace(START, block_size=2 << 20)  # the first step the search tries
    disk = FakeDisk(lucky=lucky)
    result = search(disk, budget=1000).run()
    assert disk.calls.count(lucky) > 1
    assert result.best != lucky
    assert result.best.engine == "libaio" and result.best.block_size == 256 << 10


def test_bad_budget():
    with pytest.raises(ValueError, match="positive number of seconds"):
        Search(FakeDisk().measure, START, KNOBS, 0)


def test_knobs_fit_the_transfer_and_start_outside_the_lists():
    knobs = {k.name: k for k in default_knobs(["posix"], 300 << 10)}
    assert [v["block_size"] for v in knobs["block_size"].values] == [128 << 10, 256 << 10]
    odd = AioConfig(block_size=3 << 20, queue_depth=5, engine="posix")
    assert knobs["queue_depth"].index(odd) is None
    disk = FakeDisk()
    result = Search(
        disk.measure, odd, [Knob("engine", ({"engine": "posix"}, {"engine": "libaio"}), False)], 100, clock=disk.clock
    ).run()
    assert result.best == dataclasses.replace(odd, engine="libaio")


# -- the command ---------------------------------------------------------------------------------------------------
def test_tune_within_budget_and_output_loads_unchanged(aio, scratch, tmp_path, capsys):
    output = tmp_path / "aio.json"
    budget = 3.0
    begin = time.monotonic()
    code = main(["tune", "--path", str(scratch), "--budget", str(budget), "--size", "8M", "--output", str(output)])
    elapsed = time.monotonic() - begin
    out = capsys.readouterr().out
    assert code == 0
    assert elapsed < budget + 3.0  # a trial of 8 MiB takes milliseconds; the margin is for a busy shared machine
    data = json.loads(output.read_text())
    assert tuple(data) == AioConfig.keys()
    assert all(type(data[k]) is int for k in ("block_size", "queue_depth", "intra_op_parallelism"))
    assert all(type(data[k]) is bool for k in ("single_submit", "overlap_events"))
    assert data["engine"] in aio.engines()
    assert AioConfig.from_json(output).to_dict() == data
    assert "optimised for combined read+write" in out and "trials" in out and "GB/s" in out
    assert list(scratch.iterdir()) == []


def test_plot_without_matplotlib_fails_before_measuring(scratch, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    output = tmp_path / "aio.json"
    code = main(
        ["tune", "--path", str(scratch), "--budget", "30", "--output", str(output), "--plot", str(tmp_path / "p.png")]
    )
    err = capsys.readouterr().err
    assert code == 1 and "pip install matplotlib" in err
    assert not output.exists() and list(scratch.iterdir()) == []


def test_plot(aio, scratch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    picture = tmp_path / "p.png"
    code = main(
        [
            "tune",
            "--path",
            str(scratch),
            "--budget",
            "2",
            "--size",
            "4M",
            "--output",
            str(tmp_path / "aio.json"),
            "--plot",
            str(picture),
        ]
    )
    assert code == 0 and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--budget", "0"], "positive number of seconds"),
        (["--budget", "-2"], "positive number of seconds"),
        (["--output", "/nonexistent-folder/aio.json"], "cannot write"),
    ],
)
def test_bad_arguments(scratch, capsys, argv, message):
    assert main(["tune", "--path", str(scratch), *argv]) == 1
    assert message in capsys.readouterr().err


def test_not_a_folder(aio, scratch, tmp_path, capsys):
    a_file = scratch / "file"
    a_file.write_bytes(b"x")
    assert (
        main(["tune", "--path", str(a_file), "--budget", "5", "--size", "1M", "--output", str(tmp_path / "aio.json")])
        == 1
    )
    assert "is not an existing folder" in capsys.readouterr().err


def test_unwritable_output_fails_before_searching(aio, scratch, capsys, monkeypatch):
    import os

    if not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    from deepoffload.bench import search as search_module

    monkeypatch.setattr(search_module.Search, "run", lambda self: pytest.fail("searched before checking --output"))
    assert main(["tune", "--path", str(scratch), "--budget", "30", "--size", "1M", "--output", "/proc/x.json"]) == 1
    assert "cannot write /proc/x.json" in capsys.readouterr().err
    assert list(scratch.iterdir()) == []


def test_output_check_leaves_no_file(tmp_path):
    from deepoffload.cli.tune import check_writable

    check_writable(str(tmp_path / "new.json"))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old.json").write_text("{}")
    check_writable(str(tmp_path / "old.json"))
    assert (tmp_path / "old.json").read_text() == "{}"


def test_budget_shorter_than_setup_says_why(aio, scratch, tmp_path, capsys):
    assert (
        main(
            [
                "tune",
                "--path",
                str(scratch),
                "--budget",
                "0.001",
                "--size",
                "1M",
                "--output",
                str(tmp_path / "aio.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "1 trial in " in out and "of a 0.001 s budget" in out
    assert re.search(
        r"the budget was too short to search: setup .* took [\d.]+ s and one trial [\d.]+ s, and one "
        r"trial always runs .*; pass --budget \d+ or more",
        out,
    )


def test_best_marker_agrees_with_the_table():
    """The best config is the highest median among configs measured more than once; the table shows that median
    on every row of a config, so a starred row's single score may be low without contradicting the star."""
    from deepoffload.bench.search import SearchResult, Trial
    from deepoffload.cli.tune import format_trials

    best, lucky, other = AioConfig(queue_depth=8), AioConfig(queue_depth=64), AioConfig(queue_depth=4)
    trials = [
        Trial(best, 0.919, 0.919, 1, "search"),
        Trial(lucky, 1.5, 1.5, 1, "search"),
        Trial(other, 1.2, 1.2, 1, "search"),
        Trial(best, 1.7, 1.7, 1, "repeat"),
        Trial(other, 1.0, 1.0, 1, "repeat"),
        Trial(best, 1.6, 1.6, 1, "repeat"),
    ]
    table = format_trials(SearchResult(best, 1.6, 1.6, 1.6, trials, 3.0, 10.0, "converged"), True)
    rows = [line.split() for line in table.splitlines()[2:]]
    starred = [r for r in rows if r[-1].endswith("*")]
    assert len(starred) == 3 and {r[-2] for r in starred} == {"1.600"}  # the median column, on every best row
    repeated = [float(r[-2]) for r in rows if int(r[-1].rstrip("*")) > 1]
    assert max(repeated) == 1.6
    assert "highest median among configs measured more than once" in table.splitlines()[0]
