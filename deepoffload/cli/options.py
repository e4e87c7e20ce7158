"""Options several commands share."""

from __future__ import annotations

import argparse


def add_folders(parser: argparse.ArgumentParser, help: str, required: bool = False) -> None:
    """Adds ``--path``/``--folder`` (repeatable, one per drive; ``args.path``, a list) to ``parser``.

    Args:
        parser: The command's subparser.
        help: What the folders are for, in the help text.
        required: Whether at least one must be given.
    """
    parser.add_argument("--path", "--folder", dest="path", action="append", required=required, metavar="DIR", help=help)
