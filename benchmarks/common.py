"""Shared by the storage benchmarks: a ratio row (medians and per-round ratios), the memory state before a timed
load, and a main that turns a ``BenchError`` into one line on stderr and exit status 1."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Sequence

from deepoffload.bench.measure import BenchError
from deepoffload.io.buffers import aligned_empty

MEMORY_STATES = ("recycled", "reported")


def settle_memory(state: str, nbytes: int) -> None:
    """Put the system's free memory in a known state before a timed load into ``nbytes`` of new memory.

    On a virtual machine whose balloon reports free memory to the host (virtio-balloon free page reporting, as on
    this project's VM), memory the guest has not used for a few seconds is handed back, and touching it again costs
    a fault in the host: measured here, touching 1 GiB of new memory ran at 9.5 GB/s right after an equal amount was
    freed and at 1.06 GB/s after 5 s idle. Which state a loader meets then decides its speed more than the loader
    does. ``recycled``: allocate, touch and free 1.25 x ``nbytes`` just before, so every loader gets memory the
    guest holds (as on a physical machine). ``reported``: wait 5 s first, so every loader pays the host's faults.
    """
    if state == "recycled":
        scratch = aligned_empty(nbytes + nbytes // 4, pin=False)
        scratch[::4096].fill_(0)
        del scratch
    elif state == "reported":
        time.sleep(5)
    else:
        raise ValueError(f"memory state {state!r}: expected one of {MEMORY_STATES}")


def ratio_row(label: str, numerator: Sequence[float], denominator: Sequence[float], widths: Sequence[int]) -> str:
    """``label``, the two medians, the median of the per-round ratios numerator/denominator, then every ratio.
    ``widths``: columns of the two medians and the ratio."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    a, b, r = widths
    return (
        f"{label}{statistics.median(numerator):{a}.3f}{statistics.median(denominator):{b}.3f}"
        f"{statistics.median(ratios):{r}.3f}   " + " ".join(f"{x:.2f}" for x in ratios)
    )


def run_main(name: str, main: Callable[[], int]) -> None:
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        sys.exit(1)


def write_json(
    path: str, benchmark: str, title: str, results: list[dict], unit: str = "ratio", extra: dict | None = None
) -> None:
    """Write a benchmark's results where ``--json PATH`` asked, in the format ``benchmarks/plot.py`` draws: the
    command, the machine and the date with them. Each result is ``{"label", "value"}``, optionally ``"bound"`` (the
    bound or target it is measured against), ``"higher_is_better"`` (default true) and ``"per_round"``.
    ``extra={"kind": "curve", "x_label": ...}``: each result is a series ``{"label", "x": [...], "y": [...]}`` instead,
    drawn as lines (``unit`` labels the y axis)."""
    import datetime
    import json
    import os
    import platform

    record = {
        "benchmark": benchmark,
        "title": title,
        "command": "python " + " ".join([f"benchmarks/{benchmark}.py", *sys.argv[1:]]),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "unit": unit,
        "results": results,
        **(extra or {}),
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
