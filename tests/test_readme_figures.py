"""Every figure in the README comes from a benchmark result recorded in the repository (benchmarks/results/*.json,
the data of the benchmarks page), and the README quotes no time outside them: a figure measured once and copied by
hand goes stale (the README once said "0.37x the time" for a ratio measured at 0.74-0.78 later, and times of the
build and the demo seen on no machine since)."""

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


def recorded() -> tuple[list[float], str]:
    """(every recorded result's value, the titles and commands of the result files as one text)."""
    values, texts = [], []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        values += [float(r["value"]) for r in data["results"]]
        texts += [data.get("title", ""), data.get("command", "")]
    return values, "\n".join(texts)


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


def test_each_figure_of_the_measured_table_is_a_recorded_result():
    values, texts = recorded()
    rows = table()
    assert len(rows) >= 4
    for what, result in rows:
        for printed in NUMBER.findall(result):
            assert matches(printed, values), f"README: {printed} ({what}: {result}) is no recorded result"
        for size in re.findall(r"\d+(?:\.\d+)? ?[KMG]i?B", what):  # sizes in the description: the benchmark's
            assert size in texts, f"README: {size} ({what}) is in no recorded benchmark's title or command"


def test_a_figure_that_is_not_recorded_fails():
    values, _ = recorded()
    assert matches("1.23", values) and matches("1.20", values)
    assert not matches("0.37", [0.74, 0.78]) and not matches("1.2", [1.26])


def test_the_readme_quotes_no_time_outside_the_recorded_results():
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)  # code blocks: arguments, not claims
    times = re.findall(r"(?<![\w.])\d+(?:\.\d+)? ?(?:s|seconds?|min|minutes?|hours?)\b", text)
    assert not times, f"README quotes times no recorded result backs: {times}"
