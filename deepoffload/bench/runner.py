"""One benchmark run: our transfers, fio's and the baselines' on one test file, interleaved loop by loop.

Each loop runs ours, fio, mmap and torch for writes, then the same for reads, so a noisy shared disk affects all
alike.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config import AioConfig
from ..diagnostics import direct_io_works
from ..io.handle import AsyncIOHandle
from . import baselines
from .fio import fio_executable, run_fio
from .measure import BUFFER_KINDS, OPS, BenchError, Sample, make_buffer, scratch_file, time_transfer

BASELINES: dict[str, tuple[Callable[..., Sample], ...]] = {
    "write": (baselines.mmap_write, baselines.torch_save),
    "read": (baselines.mmap_read, baselines.torch_load),
}
UNITS = {"throughput": "GB/s (1e9 bytes per second)", "time": "seconds", "size": "bytes"}


@dataclass(frozen=True)
class BenchSettings:
    """What to measure: ``nbytes`` (bytes per transfer and test-file size) in ``folder`` with ``config``.

    Attributes:
        folder: The folder on the storage to measure (the test file is made there).
        nbytes: Bytes per transfer, and the test file's size.
        config: The async-IO settings (default: ``AioConfig.from_env()``).
        ops: The transfers to time, some of ``write`` and ``read``.
        loops: How many times each transfer is timed (at least 1).
        buffer: The buffer kind: ``pinned`` or ``unaligned`` (see ``make_buffer``).
        compare_fio: Also time fio on the same file and settings.
        baselines: Also time mmap and torch.save/torch.load.

    Raises:
        ValueError: When ``loops``, ``ops`` or ``buffer`` is not one of the values above.
    """

    folder: Path
    nbytes: int
    config: AioConfig = field(default_factory=AioConfig.from_env)
    ops: tuple[str, ...] = OPS
    loops: int = 3
    buffer: str = "pinned"
    compare_fio: bool = False
    baselines: bool = False

    def __post_init__(self) -> None:
        if self.loops < 1:
            raise ValueError(f"loops must be at least 1, got {self.loops}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops must be some of {OPS}, got {self.ops}")
        if self.buffer not in BUFFER_KINDS:
            raise ValueError(f"buffer must be one of {BUFFER_KINDS}, got {self.buffer!r}")


@dataclass
class BenchResult:
    """What a run measured.

    Attributes:
        settings: What was measured.
        engine: The engine the handle used.
        direct_io: Whether the test file took O_DIRECT.
        samples: Every timed transfer, in the order they ran.
    """

    settings: BenchSettings
    engine: str
    direct_io: bool
    samples: list[Sample]

    def series(self, tool: str, op: str) -> list[Sample]:
        """The samples of ``tool`` (``deepoffload``, ``fio``, ...) for ``op``, one per loop, in order.

        Args:
            tool: The tool that moved the bytes.
            op: ``read`` or ``write``.

        Returns:
            The samples.
        """
        return [s for s in self.samples if s.tool == tool and s.op == op]

    def ratios(self, op: str, other: str = "fio") -> list[float]:
        """Per-loop ratio of our throughput to ``other``'s (loop i with loop i).

        Args:
            op: ``read`` or ``write``.
            other: The tool compared with (default ``fio``).

        Returns:
            One ratio per loop.
        """
        return [ours.gbps / theirs.gbps for ours, theirs in zip(self.series("deepoffload", op), self.series(other, op))]

    def to_dict(self) -> dict[str, Any]:
        """The result as ``deepoffload bench --json`` prints it.

        Returns:
            Units, settings, the engine and, per op, each tool's summary (see ``summarize``) and its ratios to ours.
        """
        s = self.settings
        results: dict[str, Any] = {}
        for op in s.ops:
            tools = dict.fromkeys(x.tool for x in self.samples if x.op == op)
            entry: dict[str, Any] = {tool: summarize(self.series(tool, op)) for tool in tools}
            for other in tools:
                if other != "deepoffload":
                    ratios = self.ratios(op, other)
                    entry[f"ratio_vs_{other}"] = {"per_loop": ratios, "median": statistics.median(ratios)}
            results[op] = entry
        return {
            "units": UNITS,
            "path": str(s.folder),
            "file_bytes": s.nbytes,
            "loops": s.loops,
            "buffer": s.buffer,
            "direct_io": self.direct_io,
            "config": {**s.config.to_dict(), "engine": self.engine},
            "results": results,
        }


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """Per-loop and median throughput (GB/s) and time per block request and per whole transfer (seconds).

    Args:
        samples: One tool's samples for one op (at least one).

    Returns:
        The summary, keyed as in ``deepoffload bench --json``.
    """
    return {
        "gbps": [x.gbps for x in samples],
        "median_gbps": statistics.median(x.gbps for x in samples),
        "bytes_per_transfer": samples[0].nbytes,
        "requests_per_transfer": samples[0].requests,
        "seconds_per_transfer": [x.seconds for x in samples],
        "median_seconds_per_transfer": statistics.median(x.seconds for x in samples),
        "median_seconds_per_request": statistics.median(x.seconds_per_request for x in samples),
    }


def run(settings: BenchSettings, on_sample: Callable[[Sample], None] | None = None) -> BenchResult:
    """Measure as ``settings`` say; the test file is removed afterwards, also on errors.

    A transfer that fails raises the handle's ``OSError``.

    Args:
        settings: What to measure.
        on_sample: Called with each sample as soon as it is taken (for progress output).

    Returns:
        The samples, with the engine used and whether the file took O_DIRECT.

    Raises:
        BenchError: For problems the user can fix (no fio, too little memory or space, a folder that refuses
            O_DIRECT with ``compare_fio``, ...).
    """
    s = settings
    if s.compare_fio:
        fio_executable()  # fail before spending time when fio is missing
    buffer = make_buffer(s.nbytes, s.buffer)
    spare = 1 << 20 if s.baselines else 0
    samples: list[Sample] = []
    with scratch_file(s.folder, s.nbytes, spare) as path, AsyncIOHandle(s.config) as handle:
        direct = direct_io_works(path)
        if s.compare_fio and not direct:
            raise BenchError(
                f"{s.folder} refuses O_DIRECT, so fio cannot run there with direct=1; leave out "
                f"--compare-fio or pass --path a folder on a real disk"
            )
        if s.baselines:  # torch.load needs a file torch.save wrote; everything else reads its first nbytes
            baselines.torch_save(buffer, path)
        else:
            handle.write(buffer, path)
        for _ in range(s.loops):
            for op in s.ops:
                steps: list[Callable[[], Sample]] = [lambda: time_transfer(handle, op, buffer, path, direct)]
                if s.compare_fio:
                    c = s.config
                    steps.append(
                        lambda: run_fio(path, op, s.nbytes, c.block_size, c.queue_depth, c.intra_op_parallelism)
                    )
                if s.baselines:
                    steps.extend(functools.partial(f, buffer, path) for f in BASELINES[op])
                for step in steps:
                    sample = step()
                    samples.append(sample)
                    if on_sample is not None:
                        on_sample(sample)
        return BenchResult(s, handle.engine, direct, samples)
