"""Every figure in the README and in the benchmarks page's summary table comes from a benchmark result recorded in the
repository (benchmarks/results/*.json, the data of the benchmarks page's plots), and the README quotes no time outside
them: a figure measured once and copied by hand goes stale (the README once said "0.37x the time" for a ratio measured
at 0.74-0.78 later, and times of the build and the demo seen on no machine since)."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
RESULTS = REPO / "benchmarks" / "results"
pytestmark = pytest.mark.skipif(not README.exists() or not RESULTS.is_dir(), reason="needs the source tree")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


# Each row of the README's "Measured" table (by the start of its "what" column) -> the recorded results its figures
# are, in the order it prints them: (results file, label) for one value, or (file, "min"/"max") for the range of the
# file's values. A figure must be its own result, not merely some recorded value (3.47x changed into 2.94x, a
# value of another row, must fail).
SOURCES = {
    "each engine against fio": [("engines_vs_fio", "min"), ("engines_vs_fio", "max")],
    "`deepoffload.save` against `torch.save`": [
        ("checkpoint", "torch.save + fsync / deepoffload.save"),
        ("checkpoint", "raw op write, new file+fsync+rename / deepoffload.save"),
    ],
    "`deepoffload.load` against `torch.load`": [
        ("checkpoint", "torch.load / deepoffload.load"),
        ("checkpoint", "raw op read, fresh memory / deepoffload.load"),
    ],
    "offloaded AdamW step": [
        ("optimizer_overlap", "MLP: step_in_backward / max(in memory, IO alone)"),
        ("optimizer_overlap", "MLP: offloaded / max(in memory, IO alone)"),
    ],
}


def result(name: str, label: str) -> float:
    """The recorded value of ``label`` in benchmarks/results/``name``.json ("min"/"max": of all its values)."""
    values = {r["label"]: float(r["value"]) for r in json.loads((RESULTS / f"{name}.json").read_text())["results"]}
    if label in ("min", "max"):
        return min(values.values()) if label == "min" else max(values.values())
    return values[label]


def texts() -> str:
    """The titles and commands of the result files, as one text."""
    found = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        found += [data.get("title", ""), data.get("command", "")]
    return "\n".join(found)


def table() -> list[tuple[str, str]]:
    """(what, result) of each row of the README's "Measured" table."""
    text = README.read_text()
    section = text[text.index("## Measured") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("|")]
    return [(what.strip(), result.strip()) for what, result, *_ in rows[2:]]


def matches(printed: str, values: list[float]) -> bool:
    """Whether ``printed`` is one of ``values`` rounded to the digits it shows."""
    half = Decimal(1).scaleb(Decimal(printed).as_tuple().exponent) / 2
    return any(abs(Decimal(str(v)) - Decimal(printed)) <= half for v in values)


def test_each_figure_of_the_measured_table_is_its_recorded_result():
    rows = table()
    assert len(rows) >= 4
    for what, printed in rows:
        source = next((v for k, v in SOURCES.items() if what.startswith(k)), None)
        assert source is not None, f"README row {what!r}: no recorded result named for it in SOURCES"
        figures = NUMBER.findall(printed)
        assert len(figures) == len(source), f"README: {printed} ({what}): {len(figures)} figures, {len(source)} sources"
        for figure, (name, label) in zip(figures, source):
            value = result(name, label)
            assert matches(figure, [value]), f"README: {figure} ({what}) is not {name}.json's {label!r}: {value}"
        for size in re.findall(r"\d+(?:\.\d+)? ?[KMG]i?B", what):  # sizes in the description: the benchmark's
            assert size in texts(), f"README: {size} ({what}) is in no recorded benchmark's title or command"


def test_a_figure_that_is_not_recorded_fails():
    step = result("optimizer_overlap", "MLP: offloaded / max(in memory, IO alone)")
    assert matches(f"{step:.2f}", [step]) and not matches(f"{step + 0.05:.2f}", [step])
    assert matches("1.20", [result("engines_vs_fio", "max")])
    assert not matches("2.29", [result("checkpoint", "torch.save + fsync / deepoffload.save")])  # another row's
    assert not matches("0.37", [0.74, 0.78]) and not matches("1.2", [1.26])


def test_the_readme_quotes_no_time_outside_the_recorded_results():
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)  # code blocks: arguments, not claims
    times = re.findall(r"(?<![\w.])\d+(?:\.\d+)? ?(?:s|seconds?|min|minutes?|hours?)\b", text)
    assert not times, f"README quotes times no recorded result backs: {times}"


# The benchmarks page's summary table: each row names its results file by its command (``--only NAME``,
# ``results/NAME.json`` or ``benchmarks/NAME.py``; "same" is the row above's). A figure there must be one of that
# file's recorded values (a median or a round), to the digits it shows; figures with a unit (GB/s, s, MB) are
# context measured outside the file. Weaker than the README's check (any value of the row's own file), it still
# catches a figure left behind when its file was re-measured.
PAGE = REPO / "docs" / "benchmarks.md"
PAGE_FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])(?!\s*(?:GB/s|s\b|MB|MiB|GiB|drives\b|x\b))")


def recorded(name: str) -> list[float]:
    """Every median and round recorded in benchmarks/results/``name``.json."""
    found = []
    for entry in json.loads((RESULTS / f"{name}.json").read_text())["results"]:
        found += [float(entry["value"]), *map(float, entry.get("per_round") or [])]
    return found


def page_rows() -> list[tuple[str, str, str]]:
    """(what, figure, results file) of each row of the benchmarks page's summary table."""
    text = PAGE.read_text()
    section = text[text.index("## Summary") :]
    section = section[: section.index("\n## ", 1)]
    rows, name = [], ""
    for line in section.splitlines()[4:]:
        if not line.startswith("|"):
            continue
        what, figure, _target, command, _date = (cell.strip() for cell in line.split("|")[1:-1])
        named = [re.search(pattern, command) for pattern in (r"--only (\w+)", r"results/(\w+)\.json", r"s/(\w+)\.py")]
        if any(named):
            name = next(found.group(1) for found in named if found)
        elif not command.startswith("same"):
            name = ""
        rows.append((what, figure, name))
    return rows


def test_each_figure_of_the_benchmarks_summary_is_recorded_in_its_results_file():
    rows = page_rows()
    assert len(rows) >= 10
    for what, figure, name in rows:
        figures = PAGE_FIGURE.findall(figure)
        if not figures:
            continue
        assert (RESULTS / f"{name}.json").is_file(), f"benchmarks page: {what!r}: no results file for {figure!r}"
        values = recorded(name)
        for printed in figures:
            assert matches(printed, values), f"benchmarks page: {printed} ({what}) is not recorded in {name}.json"


def test_a_stale_figure_of_the_benchmarks_summary_fails():
    values = recorded("optimizer_overlap")
    assert not matches("1.41", values)  # the page's old figure for step_in_backward over the step with its IO
    assert matches(f"{values[0]:.2f}", values)
