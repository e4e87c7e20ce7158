"""Several drives measured alone and all together: what ``deepoffload bench --folder A --folder B`` and ``tune`` report.

Each loop times, per direction, every drive alone (one handle, one file) and then all drives at once (one handle and
one file per drive, every transfer submitted before any is waited for), interleaved so that a change of load during
the run touches every figure alike. The aggregate is the bytes moved over the wall time of the concurrent round;
the sum of the drives' own medians is what it is compared to (ideal: 1.0).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import AioConfig
from ..diagnostics import direct_io_works
from ..io.handle import AsyncIOHandle
from .measure import evict, make_buffer, scratch_file, time_transfer


@dataclass
class DriveResult:
    """Each drive's GB/s alone and all drives' aggregate GB/s, per loop, for each op.

    Attributes:
        folders: The folders, one per drive.
        nbytes: Bytes per drive per transfer.
        alone: ``{op: [[GB/s per loop] per drive]}``.
        together: ``{op: [aggregate GB/s per loop]}``.
    """

    folders: list[str]
    nbytes: int
    alone: dict[str, list[list[float]]]
    together: dict[str, list[float]]

    def to_dict(self) -> dict:
        """The result as JSON-ready data, with medians and the aggregate over the sum of the drives' medians.

        Returns:
            ``{"folders", "bytes_per_drive", "results": {op: {"drives": [...], "together": {...}}}}``.
        """
        results = {}
        for op, per_drive in self.alone.items():
            medians = [statistics.median(loops) for loops in per_drive]
            together = statistics.median(self.together[op])
            results[op] = {
                "drives": [
                    {"folder": f, "gbps": g, "median_gbps": m} for f, g, m in zip(self.folders, per_drive, medians)
                ],
                "together": {"gbps": self.together[op], "median_gbps": together, "of_sum": together / sum(medians)},
            }
        return {"folders": self.folders, "bytes_per_drive": self.nbytes, "results": results}


def _together(
    handles: list[AsyncIOHandle], op: str, buffers: list[torch.Tensor], paths: list[Path], direct: list[bool]
):
    if op == "read":
        for path in paths:
            evict(path)
    start = time.perf_counter()
    if op == "write":
        pending = [
            h.write_async(b, p, truncate=False, fsync=not d) for h, b, p, d in zip(handles, buffers, paths, direct)
        ]
    else:
        pending = [h.read_async(b, p) for h, b, p in zip(handles, buffers, paths)]
    for request in pending:
        request.wait()
    seconds = time.perf_counter() - start
    return sum(b.numel() for b in buffers) / seconds / 1e9


def measure_drives(
    folders: list[str], nbytes: int, config: AioConfig, ops: tuple[str, ...] = ("write", "read"), loops: int = 3
) -> DriveResult:
    """Time each drive alone and all together, ``loops`` times, interleaved.

    Args:
        folders: One folder per drive.
        nbytes: Bytes per drive per transfer.
        config: The handles' settings.
        ops: ``write`` and/or ``read`` (a read needs the write first: ``read`` alone writes once, untimed).
        loops: Rounds.

    Returns:
        The samples.

    Raises:
        BenchError: When a folder is missing, not writable or too full (``scratch_file``).
    """
    buffers = [make_buffer(nbytes, "pinned") for _ in folders]
    alone: dict[str, list[list[float]]] = {op: [[] for _ in folders] for op in ops}
    together: dict[str, list[float]] = {op: [] for op in ops}
    with contextlib.ExitStack() as stack:
        paths = [stack.enter_context(scratch_file(folder, nbytes)) for folder in folders]
        handles = [stack.enter_context(AsyncIOHandle(config)) for _ in folders]
        direct = [direct_io_works(path) for path in paths]
        for handle, buffer, path, d in zip(handles, buffers, paths, direct):
            time_transfer(handle, "write", buffer, path, d)  # lays the files out (untimed)
        for _ in range(loops):
            for op in ops:
                for i, (handle, buffer, path, d) in enumerate(zip(handles, buffers, paths, direct)):
                    alone[op][i].append(time_transfer(handle, op, buffer, path, d).gbps)
                together[op].append(_together(handles, op, buffers, paths, direct))
    return DriveResult([str(f) for f in folders], nbytes, alone, together)


def format_drives(report: dict) -> str:
    """The text table of ``DriveResult.to_dict()``: each drive's and the aggregate's loops and medians.

    Args:
        report: ``DriveResult.to_dict()``.

    Returns:
        The table's lines, joined.
    """
    lines = [f"deepoffload bench  {len(report['folders'])} drives  {report['bytes_per_drive']} bytes per drive per "]
    lines[0] += "transfer; GB/s (1e9 bytes/s); alone: one drive at a time; together: every drive at once"
    for op, entry in report["results"].items():
        lines += ["", f"{op:<8}{'folder':<40}{'loops':>30}{'median':>9}"]
        for drive in entry["drives"]:
            loops = " ".join(f"{g:7.3f}" for g in drive["gbps"])
            lines.append(f"  alone {drive['folder']:<40.40}{loops:>30}{drive['median_gbps']:9.3f}")
        t = entry["together"]
        loops = " ".join(f"{g:7.3f}" for g in t["gbps"])
        lines.append(f"  {'together (all drives)':<46}{loops:>30}{t['median_gbps']:9.3f}")
        lines.append(f"  together / sum of the drives' medians: {t['of_sum']:.3f}")
    return "\n".join(lines)


def drive_speeds(report: dict) -> list[float]:
    """Each drive's speed for ``SwapConfig.folder_speeds``: its bytes written and read back over their median times.

    Args:
        report: ``DriveResult.to_dict()`` with ``write`` and ``read``.

    Returns:
        One round-trip GB/s per drive (``2 / (1 / write + 1 / read)``), rounded to 3 digits.
    """
    writes = [d["median_gbps"] for d in report["results"]["write"]["drives"]]
    reads = [d["median_gbps"] for d in report["results"]["read"]["drives"]]
    return [round(2 / (1 / w + 1 / r), 3) for w, r in zip(writes, reads)]
