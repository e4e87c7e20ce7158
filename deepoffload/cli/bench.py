"""``deepoffload bench``: how fast a folder's storage is through deepoffload, per loop and median.

Optionally side by side with fio (same file, block size, queue depth, O_DIRECT) and with mmap and
torch.save/torch.load.

Throughput is in GB/s = 1e9 bytes per second. Exit status: 0 on success, 1 on an error (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from .options import add_folders


def size_argument(text: str) -> int:
    """argparse type for byte sizes with K/M/G suffixes (see ``deepoffload.bench.sizes``)."""
    from ..bench.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def positive_int(text: str) -> int:
    """argparse type for counts that must be at least 1."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_knob_arguments(parser: argparse.ArgumentParser) -> None:
    """--config and the async-IO knobs; ones given override the config file (or the defaults)."""
    parser.add_argument("--config", metavar="FILE", help="start from this aio JSON config (e.g. from `tune`)")
    parser.add_argument(
        "--block-size", type=size_argument, metavar="BYTES", help="bytes per IO request (K/M/G suffixes)"
    )
    parser.add_argument("--queue-depth", type=positive_int, metavar="N", help="requests in flight per thread")
    parser.add_argument(
        "--threads", type=positive_int, metavar="N", help="threads sharing one transfer (intra_op_parallelism)"
    )
    from ..io.engines import choices

    parser.add_argument("--engine", choices=choices(), help="async-IO engine (the registered ones, or auto)")


def config_from_args(args: argparse.Namespace):
    """The ``AioConfig`` the options ask for: ``--config`` (else the environment's), with the knobs given overriding it.

    Args:
        args: The parsed options of ``add_knob_arguments``.

    Returns:
        The ``AioConfig``.
    """
    from ..config import AioConfig

    base = AioConfig.from_json(args.config) if args.config else AioConfig.from_env()
    overrides = {
        key: value
        for key, value in (
            ("block_size", args.block_size),
            ("queue_depth", args.queue_depth),
            ("intra_op_parallelism", args.threads),
            ("engine", args.engine),
        )
        if value is not None
    }
    return AioConfig.from_dict(overrides, base=base)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``deepoffload bench``'s options to ``parser``.

    Args:
        parser: The command's subparser.
    """
    add_folders(
        parser,
        "folder on the storage to measure; repeat for several drives: each alone, then all together",
        required=True,
    )
    parser.add_argument(
        "--size",
        type=size_argument,
        default="1G",
        metavar="BYTES",
        help="test file size = bytes per transfer (K/M/G suffixes, powers of 1024; default 1G)",
    )
    add_knob_arguments(parser)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--read", dest="ops", action="store_const", const=("read",), help="reads only")
    which.add_argument("--write", dest="ops", action="store_const", const=("write",), help="writes only")
    which.add_argument(
        "--both", dest="ops", action="store_const", const=("write", "read"), help="writes and reads (default)"
    )
    parser.add_argument(
        "--loops", type=positive_int, default=3, metavar="N", help="timed transfers per kind (default 3)"
    )
    parser.add_argument(
        "--buffer",
        choices=("pinned", "unaligned"),
        default="pinned",
        help="pinned: page-aligned, page-locked (zero copy); unaligned: through bounce buffers",
    )
    parser.add_argument("--compare-fio", action="store_true", help="run fio interleaved with ours, print ours/fio")
    parser.add_argument("--baselines", action="store_true", help="also time mmap and torch.save/torch.load+fsync")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    """Runs ``deepoffload bench``: measures, then prints a table (or JSON).

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0 on success, 1 on an error (one line on stderr).

    Raises:
        BrokenPipeError: When the reader of stdout went away (``deepoffload.cli.main`` then stops quietly).
    """
    from ..bench.measure import BenchError
    from ..config import ConfigError

    try:
        return _run(args)
    except BrokenPipeError:  # stdout's reader left: deepoffload.cli.main stops quietly
        raise
    except (BenchError, ConfigError, ValueError, OSError) as e:
        print(f"deepoffload bench: error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..bench.runner import BenchSettings
    from ..bench.runner import run as run_bench

    if len(args.path) > 1:
        return _run_drives(args)
    settings = BenchSettings(
        folder=Path(args.path[0]),
        nbytes=args.size,
        config=config_from_args(args),
        ops=args.ops or ("write", "read"),
        loops=args.loops,
        buffer=args.buffer,
        compare_fio=args.compare_fio,
        baselines=args.baselines,
    )
    progress = (
        None
        if args.json
        else (lambda s: print(f"  {s.op:5} {s.tool:11} {s.gbps:7.3f} GB/s", file=sys.stderr, flush=True))
    )
    result = run_bench(settings, progress)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_table(result.to_dict()))
    return 0


def _run_drives(args: argparse.Namespace) -> int:
    from ..bench.drives import format_drives, measure_drives
    from ..bench.measure import BenchError

    if args.compare_fio or args.baselines or args.buffer != "pinned":
        raise BenchError("--compare-fio, --baselines and --buffer take one --folder; several drives are measured alone")
    result = measure_drives(args.path, args.size, config_from_args(args), args.ops or ("write", "read"), args.loops)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_drives(result.to_dict()))
    return 0


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3f} ms" if value < 1 else f"{value:.3f} s"


def format_table(report: dict) -> str:
    """The text table of a bench result: settings, then per op each tool's loops, median and times, and the ratios.

    Args:
        report: ``BenchResult.to_dict()``.

    Returns:
        The table's lines, joined.
    """
    from ..bench.sizes import format_size

    c = report["config"]
    lines = [
        f"deepoffload bench  {report['path']}  {report['file_bytes']} bytes ({format_size(report['file_bytes'])}) "
        f"per transfer  {report['buffer']} buffer  {'O_DIRECT' if report['direct_io'] else 'buffered (fsync)'}",
        f"engine {c['engine']}  block_size {c['block_size']} ({format_size(c['block_size'])})  queue_depth "
        f"{c['queue_depth']}  threads {c['intra_op_parallelism']}  single_submit {c['single_submit']}  "
        f"overlap_events {c['overlap_events']}",
        "throughput in GB/s (1e9 bytes/s); time per request = transfer time / block requests",
    ]
    for op, entry in report["results"].items():
        loops = len(entry["deepoffload"]["gbps"])
        header = f"{op:<18}" + "".join(f"{'loop ' + str(i + 1):>9}" for i in range(loops))
        lines += ["", header + f"{'median':>9}{'per request':>14}{'per transfer':>14}"]
        for tool, data in entry.items():
            if tool.startswith("ratio_vs_"):
                continue
            lines.append(
                f"  {tool:<16}"
                + "".join(f"{g:9.3f}" for g in data["gbps"])
                + f"{data['median_gbps']:9.3f}{_seconds(data['median_seconds_per_request']):>14}"
                + f"{_seconds(data['median_seconds_per_transfer']):>14}"
            )
        for key, data in entry.items():
            if key.startswith("ratio_vs_"):
                name = "ours/" + key.removeprefix("ratio_vs_")
                lines.append(
                    f"  {name:<16}"
                    + "".join(f"{r:9.3f}" for r in data["per_loop"])
                    + f"{data['median']:9.3f}  (median of per-loop ratios)"
                )
    return "\n".join(lines)
