"""Plots of benchmark results: each ratio as a bar, with the bound or target it is measured against as a tick, so
a reader sees at a glance how far each result is from its bound.

A file with ``"kind": "curve"`` holds series (``{"label", "x": [...], "y": [...]}``) drawn as lines instead.

Input: the JSON a benchmark writes with ``--json PATH`` (``benchmarks/common.py`` ``write_json``), or a file in
``benchmarks/results/`` in the same format. The documentation site draws ``benchmarks/results/*.json`` with this at
build time (``mkdocs_hooks.py``).

    python benchmarks/plot.py benchmarks/results/engines_vs_fio.json [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import textwrap
from pathlib import Path


def render_curve(data: dict) -> bytes:
    """PNG bytes of a ``"kind": "curve"`` file: one line per result (``x``, ``y`` lists), ``x_label`` and ``unit``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    for series in data["results"]:
        ax.plot(series["x"], series["y"], marker="o", label=series["label"])
    ax.set_xlabel(data.get("x_label", "x"), fontsize=8)
    ax.set_ylabel(data.get("unit", "value"), fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    title = textwrap.fill(data["title"], 90) + "\n" + textwrap.fill(f"{data['machine']}, {data['date']}", 90)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()


def render(data: dict) -> bytes:
    """PNG bytes of one result file's bars: ``value`` per result, ``bound`` as a black tick where given.

    A file with ``"kind": "curve"`` is drawn as lines instead (``render_curve``).
    """
    if data.get("kind") == "curve":
        return render_curve(data)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    labels = [r["label"] for r in results]
    values = [r["value"] for r in results]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(results) + 1.4), dpi=100)
    y = list(range(len(results)))[::-1]
    # green: the bound is met, red: not met, blue: no bound
    colors = [
        "#1565c0"
        if r.get("bound") is None
        else "#2e7d32"
        if (r["value"] >= r["bound"]) == r.get("higher_is_better", True)
        else "#c62828"
        for r in results
    ]
    ax.barh(y, values, color=colors, height=0.6)
    for yi, r in zip(y, results):
        ax.text(r["value"], yi, f" {r['value']:.2f}", va="center", fontsize=8)
        if r.get("bound") is not None:
            ax.plot([r["bound"]] * 2, [yi - 0.4, yi + 0.4], color="black", linewidth=2)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel(
        data.get("unit", "ratio") + "\nblack tick: the bound or target; green: met, red: not met, blue: no bound",
        fontsize=8,
    )
    title = textwrap.fill(data["title"], 90) + "\n" + textwrap.fill(f"{data['machine']}, {data['date']}", 90)
    ax.set_title(title, fontsize=8)
    ax.set_xlim(0, max(values + [r.get("bound") or 0 for r in results]) * 1.18)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()


def render_file(path: str | Path) -> bytes:
    return render(json.loads(Path(path).read_text()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", help="JSON files written by a benchmark's --json")
    parser.add_argument("--out", default=".", help="folder for the PNG files (named after the JSON files)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.results:
        target = out / (Path(name).stem + ".png")
        target.write_bytes(render_file(name))
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
