"""Shared by the storage benchmarks: a ratio row (medians and per-round ratios) and a main that turns a
``BenchError`` into one line on stderr and exit status 1."""

from __future__ import annotations

import statistics
import sys
from typing import Callable, Sequence

from deepoffload.bench.measure import BenchError


def ratio_row(label: str, numerator: Sequence[float], denominator: Sequence[float], widths: Sequence[int]) -> str:
    """``label``, the two medians, the median of the per-round ratios numerator/denominator, then every ratio.
    ``widths``: columns of the two medians and the ratio."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    a, b, r = widths
    return (f"{label}{statistics.median(numerator):{a}.3f}{statistics.median(denominator):{b}.3f}"
            f"{statistics.median(ratios):{r}.3f}   " + " ".join(f"{x:.2f}" for x in ratios))


def run_main(name: str, main: Callable[[], int]) -> None:
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        sys.exit(1)
