"""``deepoffload <command>``: the command line, one module in this package per command.

Each command module has ``add_arguments(parser)`` and ``run(args) -> int``. Command modules import torch and other
heavy modules inside ``run`` only, so building the parser stays cheap and ``report`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..version import __version__

COMMANDS = {
    "report": ("deepoffload.cli.report", "what works here and why not: ops, probes, engines, versions"),
    "bench": ("deepoffload.cli.bench", "measure read/write throughput of a folder, optionally against fio"),
    "tune": ("deepoffload.cli.tune", "search the async-IO settings that move bytes fastest here"),
    "demo": ("deepoffload.cli.demo", "train a small language model with its optimizer state on storage"),
    "plan": ("deepoffload.cli.plan", "what streaming a checkpoint's model keeps in memory under a limit"),
}
DESCRIPTION = (
    "Move PyTorch tensors and optimizer state between memory and fast storage. "
    "Start with `deepoffload report`, then `deepoffload demo`."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``deepoffload`` parser, with a subparser per command of ``COMMANDS`` (each module adds its options)."""
    parser = argparse.ArgumentParser(prog="deepoffload", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"deepoffload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs ``deepoffload`` with ``argv``: parses it and calls the command's ``run``.

    Args:
        argv: The command line after the program name; None reads ``sys.argv``.

    Returns:
        The command's exit status; 2 without a command (the help is printed), 130 on Ctrl-C, 141 (as if killed by
        SIGPIPE) when the reader of the output went away.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        status = int(importlib.import_module(args._module).run(args) or 0)
        sys.stdout.flush()  # here, so that a reader gone away is seen below and not at exit
        return status
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, with the status of a process killed by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit does not fail again
        return 128 + 13
