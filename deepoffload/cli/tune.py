"""``deepoffload tune``: search the async-IO settings that move bytes fastest in a folder, within a time budget.

The best settings are written as an aio JSON config (the keys ``AioConfig`` and the swappers read; real booleans and
numbers).

The score is the combined read+write throughput (see ``deepoffload.bench.search``). Exit status: 0 on success, 1 on
an error (one line on stderr).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

from .bench import size_argument
from .options import add_folders

PLOT_HINT = "--plot needs matplotlib, which is not installed: pip install matplotlib"
CODEC_HINT = "--codec needs zstandard, which is not installed: pip install 'deepoffload[codec]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``deepoffload tune``'s options to ``parser``.

    Args:
        parser: The command's subparser.
    """
    add_folders(
        parser,
        "folder on the storage to tune for; repeat for several drives: the search runs on the first, then each "
        "drive is measured and the output gets folder and folder_speeds (each drive's share)",
        required=True,
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="wall-clock budget, setup included; no trial starts that would end after it (default 60)",
    )
    parser.add_argument(
        "--output",
        default="aio.json",
        metavar="FILE",
        help="where to write the best config as aio JSON (default aio.json)",
    )
    parser.add_argument(
        "--size",
        type=size_argument,
        default="256M",
        metavar="BYTES",
        help="bytes per trial transfer and test-file size (K/M/G suffixes; default 256M)",
    )
    parser.add_argument(
        "--codec",
        action="store_true",
        help="also measure the lossless codec's decode speed on this CPU against the drive's read speed and write "
        "codec=lossless into the output only where it makes streaming at least 1.1x faster, else codec=none (the "
        "output then has an aio section; SwapConfig.from_json reads both)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw throughput against block size and queue depth per engine (needs matplotlib)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs ``deepoffload tune``: checks the options, searches, writes the best config and prints the trials.

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0 on success, 1 on an error (one line on stderr).

    Raises:
        BrokenPipeError: When the reader of stdout went away (``deepoffload.cli.main`` then stops quietly).
        ValueError: For a ``--budget`` that is not a positive finite number; caught here (printed, status 1), it
            does not escape.
        BenchError: When ``--plot`` is asked for without matplotlib (``--codec`` without zstandard); caught here
            (printed, status 1), it does not escape.
    """
    started = time.monotonic()  # the budget counts everything from here: importing torch, self-tests, setup
    from ..bench.measure import BenchError
    from ..config import ConfigError

    try:
        if not 0 < args.budget < math.inf:  # also NaN
            raise ValueError(f"--budget must be a positive number of seconds (not inf or nan), got {args.budget}")
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise BenchError(PLOT_HINT)
        if args.codec and importlib.util.find_spec("zstandard") is None:
            raise BenchError(CODEC_HINT)
        for name in (args.output, args.plot):
            if name:
                check_writable(name)
        return _run(args, started)
    except BrokenPipeError:  # stdout's reader left: deepoffload.cli.main stops quietly
        raise
    except (BenchError, ConfigError, ValueError, OSError) as e:
        print(f"deepoffload tune: error: {e}", file=sys.stderr)
        return 1


def check_writable(name: str) -> None:
    """Raise ``BenchError`` unless ``name`` can be written, by trying: before the search, not after it.

    Trying is the only test: permission bits do not bind the superuser, and /proc takes no new files. Leaves no new
    file behind.

    Args:
        name: The file to be written.

    Raises:
        BenchError: When the file cannot be opened for appending.
    """
    from ..bench.measure import BenchError

    existed = os.path.lexists(name)
    try:
        with open(name, "ab"):
            pass
    except OSError as e:
        raise BenchError(f"cannot write {name}: {e.strerror}; pass a file in a folder you can write to") from e
    if not existed:
        os.unlink(name)


def _run(args: argparse.Namespace, started: float) -> int:
    import dataclasses
    from pathlib import Path

    from tqdm import tqdm

    from ..bench.measure import make_buffer, round_trip, scratch_file
    from ..bench.search import SCORE_DESCRIPTION, Search, default_knobs
    from ..bench.sizes import format_size
    from ..config import AioConfig
    from ..diagnostics import direct_io_works
    from ..io.engines import engine_status, resolve_engine

    engines = [name for name, (ok, _) in engine_status().items() if ok]
    start = AioConfig.from_env()
    start = dataclasses.replace(start, engine=resolve_engine(start.engine).name)
    buffer = make_buffer(args.size, "pinned")
    with scratch_file(args.path[0], args.size) as path:
        direct = direct_io_works(path)
        round_trip(start, buffer, path, direct)  # lays the file out (untimed for the search)
        with tqdm(
            total=round(args.budget, 1),
            unit="s",
            desc="tuning",
            file=sys.stderr,
            bar_format="{desc}: {bar} {n:.1f}/{total:.1f} s{postfix}",
        ) as bar:

            def progress(trial) -> None:
                bar.n = min(round(time.monotonic() - started, 1), bar.total)
                bar.set_postfix_str(f"{len(search.trials)} trials, last {trial.score:.2f} GB/s")

            setup_s = time.monotonic() - started
            search = Search(
                lambda c: round_trip(c, buffer, path, direct),
                start,
                default_knobs(engines, args.size),
                args.budget,
                started=started,
                on_trial=progress,
            )
            result = search.run()
    config = result.best.to_dict()
    drives_table = ""
    if len(args.path) > 1:
        drives, drives_table = per_drive(args.path, args.size, result.best)
        config = {"aio": config, **drives}
    choice = None
    if args.codec:
        choice = codec_choice(result.best_read_gbps * 1e9)
        config = {"aio": config, "codec": choice.codec} if "aio" not in config else {**config, "codec": choice.codec}
    Path(args.output).write_text(json.dumps(config, indent=2) + "\n")  # first: printing fails when piped to head
    print(format_trials(result, direct))
    if drives_table:
        print(f"\n{drives_table}")
    if choice is not None:
        print(f"\n{choice.reason}")
    print(f"\noptimised for {SCORE_DESCRIPTION}")
    print(f"best: {json.dumps(config)}")
    print(
        f"      write {result.best_write_gbps:.3f} GB/s, read {result.best_read_gbps:.3f} GB/s, score "
        f"{result.best_score:.3f} GB/s (medians of {sum(t.config == result.best for t in result.trials)} trials)"
    )
    print(
        f"wrote {args.output}; {len(result.trials)} trial{'s' if len(result.trials) != 1 else ''} in "
        f"{result.elapsed_s:.1f} s of a {result.budget_s:g} s budget ({result.stopped})"
    )
    if result.elapsed_s > result.budget_s:
        trial_s = (result.elapsed_s - setup_s) / max(1, len(result.trials))
        print(
            f"the budget was too short to search: setup (loading torch and the op, self-tests, writing the "
            f"{format_size(args.size)} test file) took {setup_s:.1f} s and one trial {trial_s:.1f} s, and one trial "
            f"always runs so that there is a config to write; pass --budget "
            f"{math.ceil(setup_s + 10 * trial_s)} or more for a search"
        )
    if args.plot:
        plot(result, args.plot)
        print(f"plotted {args.plot}")
    return 0


def codec_choice(read_bytes_per_s: float):
    """The codec to stream with on a drive reading ``read_bytes_per_s``: ``lossless`` only where it pays.

    Args:
        read_bytes_per_s: The drive's read speed found by the search (bytes per second).

    Returns:
        A ``CodecChoice`` (``deepoffload.swap.codecs.choice``): the codec, its predicted speedup and the reason.
    """
    from ..swap.codecs.choice import choose, measure_decode

    decode, ratio = measure_decode()
    return choose(read_bytes_per_s, decode, ratio)


def per_drive(folders: list[str], nbytes: int, config) -> tuple[dict, str]:
    """``folder`` and ``folder_speeds`` for a swap config: each drive measured with the settings found.

    Args:
        folders: One folder per drive.
        nbytes: Bytes per transfer.
        config: The ``AioConfig`` the search found.

    Returns:
        ``{"folder": folders, "folder_speeds": [GB/s per drive]}``, and the measurements' table.
    """
    from ..bench.drives import drive_speeds, format_drives, measure_drives

    report = measure_drives(folders, nbytes, config).to_dict()
    return {"folder": list(folders), "folder_speeds": drive_speeds(report)}, format_drives(report)


def format_trials(result, direct: bool) -> str:
    """The table of every trial: its config, throughputs, score, its config's median and trial count; ``*`` = best.

    Args:
        result: The search's ``SearchResult``.
        direct: Whether the test file took O_DIRECT (named in the heading).

    Returns:
        The table's lines, joined.
    """
    import statistics

    from ..bench.sizes import format_size

    runs: dict = {}
    for t in result.trials:
        runs.setdefault(t.config, []).append(t.score)
    lines = [
        f"trials ({'O_DIRECT' if direct else 'buffered'}; GB/s = 1e9 bytes/s; score = one trial; median = "
        f"the config's median score over its n trials; * = best: the highest median among configs measured "
        f"more than once, so one lucky trial does not win)",
        f"{'#':>3} {'phase':<7} {'engine':<9} {'block':>8} {'qd':>4} {'thr':>3} {'single':>6} {'overlap':>7} "
        f"{'write':>7} {'read':>7} {'score':>7} {'median':>7} {'n':>2}",
    ]
    for i, t in enumerate(result.trials, 1):
        c = t.config
        mark = "*" if c == result.best else " "
        lines.append(
            f"{i:>3} {t.phase:<7} {c.engine:<9} {format_size(c.block_size):>8} {c.queue_depth:>4} "
            f"{c.intra_op_parallelism:>3} {str(c.single_submit):>6} {str(c.overlap_events):>7} "
            f"{t.write_gbps:7.3f} {t.read_gbps:7.3f} {t.score:7.3f} {statistics.median(runs[c]):7.3f} "
            f"{len(runs[c]):>2}{mark}"
        )
    return "\n".join(lines)


def plot(result, path: str) -> None:
    """Score of every trial against block size and against queue depth, one colour per engine.

    Args:
        result: The search's ``SearchResult``.
        path: The image file to write (matplotlib picks the format from its suffix).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    engines = sorted({t.config.engine for t in result.trials})
    for ax, key, label in ((axes[0], "block_size", "block size (bytes)"), (axes[1], "queue_depth", "queue depth")):
        for engine in engines:
            mine = [t for t in result.trials if t.config.engine == engine]
            ax.scatter([getattr(t.config, key) for t in mine], [t.score for t in mine], label=engine, alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("combined read+write GB/s (1e9 bytes/s)")
    axes[1].legend(title="engine")
    fig.suptitle("deepoffload tune")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
