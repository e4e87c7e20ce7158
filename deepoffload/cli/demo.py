"""``deepoffload demo``: train a small built-in language model with its optimizer state on storage.

The same model is trained in memory alongside; the demo reports bytes on storage, memory saved, IO throughput,
step-time overhead and whether the losses matched exactly
(``tests/demo/test_demo.py::test_demo_tiny_prints_the_summary`` checks they do).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SIZES = ("tiny", "small", "medium", "large")
OPTIMIZERS = ("adam", "adamw", "sgd", "adagrad", "rmsprop", "adafactor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``deepoffload demo``'s options to ``parser``.

    Args:
        parser: The command's subparser.
    """
    parser.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    parser.add_argument(
        "--model-size",
        choices=SIZES,
        default="small",
        help="tiny (0.1M params), small (5M, default), medium (34M), large (185M)",
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="default: adam")
    parser.add_argument(
        "--path",
        default=None,
        help="folder for the swap files, e.g. on an NVMe (default: a temporary folder in the current "
        "directory, removed at the end)",
    )
    parser.add_argument(
        "--config", default=None, metavar="JSON", help="swap/aio settings file (e.g. written by `deepoffload tune`)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the swap files for inspection")
    parser.add_argument(
        "--stream-layers",
        action="store_true",
        help="stream the model's blocks from storage too (parameter offload; own built-in model, Adam; try --steps 10)",
    )


def state_estimate(args: argparse.Namespace) -> int:
    """Bytes of optimizer state the demo's model will have (two fp32 moments per parameter)."""
    from ..demo.model import build_model

    return 8 * sum(p.numel() for p in build_model(args.model_size).parameters())


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _overhead_text(result) -> str:
    ratios = result.step_overheads
    if not ratios:
        return (
            "not compared: the only step creates the optimizer state, which in memory costs nothing to read; "
            "run --steps 3 or more"
        )
    if len(ratios) == 1:
        return (
            f"overhead {100 * ratios[0]:+.1f}% against in memory (one step compared, the second; a single "
            f"step is noisy: run more --steps)"
        )
    low, high = result.overhead_spread
    spread = "middle half of the steps" if len(ratios) >= 4 else "range"
    return (
        f"overhead {100 * result.overhead:+.1f}% against in memory (median of {len(ratios)} per-step ratios, "
        f"the two runs interleaved, first step excluded; {spread} {100 * low:+.1f}% to {100 * high:+.1f}%)"
    )


def run(args: argparse.Namespace) -> int:
    """Runs ``deepoffload demo`` (``--stream-layers``: the parameter-streaming demo) and prints what it measured.

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0 when the offloaded run's losses and parameters equal the in-memory ones, 1 when not or on
        an error (the op unusable, a bad folder), 2 for bad options or an unreadable config.
    """
    if args.steps < 1:
        print("deepoffload demo: --steps must be at least 1")
        return 2
    from tqdm import tqdm

    from ..config import ConfigError
    from ..demo.train import run_demo
    from ..swap.config import SwapConfig

    try:
        config = SwapConfig.from_json(args.config) if args.config else SwapConfig()
        chunk_set = bool(args.config) and "chunk_bytes" in json.loads(Path(args.config).read_text())
    except ConfigError as e:
        print(f"deepoffload demo: {e}")
        return 2
    if not chunk_set:  # a small model's state in ~16 chunks: the staging buffers stay a small part of it
        config = config.replace(chunk_bytes=min(config.chunk_bytes, max(1 << 20, state_estimate(args) // 16)))
    folder = args.path or config.folder or os.getcwd()
    config = config.replace(folder=folder, keep_files=args.keep or config.keep_files)
    missing = [f for f in config.folders if f is not None and not os.path.isdir(f)]
    if missing:  # as bench and tune: never create (and leave) a folder the user mistyped
        print(
            f"deepoffload demo: {missing[0]} is not an existing folder; choose another folder with --path "
            "(or create it)"
        )
        return 1
    try:  # before any progress bar: a first use builds the op and says so on its own line
        from ..io.native import native

        native()
    except Exception as e:  # BuildError (with the compiler's lines and a hint) or a load failure
        print(f"deepoffload demo: the async-IO op is not usable here: {e}\nrun `deepoffload report` to see why")
        return 1
    if args.stream_layers:
        from ..demo.stream import report_stream

        return report_stream(args.steps, config)
    print(
        f"deepoffload demo: {args.model_size} model, {args.optimizer}, {args.steps} steps, optimizer state on "
        f"storage under {config.folder} (engine {config.aio.engine}, chunks of {_mb(config.chunk_bytes)}); "
        f"the same model trains in memory alongside "
        f"for comparison"
    )
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)

    def progress(step: int, result) -> None:
        bar.update(1)
        bar.set_postfix(
            loss=f"{result.losses_offloaded[-1]:.4f}",
            step_ms=f"{1e3 * result.step_seconds_offloaded[-1]:.0f}",
            io=f"{result.io_gb_per_s:.2f} GB/s",
        )

    try:
        result = run_demo(args.model_size, args.steps, args.optimizer, config, progress)
    except OSError as e:
        bar.close()
        print(f"deepoffload demo: {e}; choose another folder with --path")
        return 1
    bar.close()
    saved = result.state_bytes_on_storage - result.staging_bytes
    print(f"parameters:                 {result.parameters:,}")
    print(
        f"optimizer state on storage: {result.state_bytes_on_storage:,} bytes ({_mb(result.state_bytes_on_storage)})"
        f"; in memory it takes {result.state_bytes_memory:,} bytes"
    )
    if saved > 0:
        print(
            f"memory saved:               {_mb(saved)} (state not in RAM, minus {_mb(result.staging_bytes)} of "
            f"staging buffers)"
        )
    else:
        print(
            f"memory saved:               none: this model's state ({_mb(result.state_bytes_on_storage)}) is "
            f"smaller than the staging buffers ({_mb(result.staging_bytes)}); offloading pays off for states much "
            f"larger than the buffers (try --model-size small)"
        )
    over = (
        "the only step, which writes the state and reads nothing"
        if result.steps == 1
        else "the offloaded optimizer steps after the first"
    )
    print(
        f"IO:                         {_mb(result.bytes_moved)} moved at {result.io_gb_per_s:.2f} GB/s "
        f"(1e9 bytes/s, over {over})"
    )
    print(f"step time:                  {_overhead_text(result)}")
    match = result.losses_match and result.params_match
    print(
        f"losses matched exactly:     {'yes' if match else 'NO'} (final loss {result.losses_offloaded[-1]:.6f}; "
        f"{len(result.losses_offloaded)} steps compared bit for bit, final parameters "
        f"{'identical' if result.params_match else 'DIFFERENT'})"
    )
    if args.keep:
        print(f"swap files kept in {result.folder}")
    return 0 if match else 1
