"""``python -m op_builder flags``: the compile and link flags the builder's probes choose for the async-IO op here.

Installed, the command is ``python -m deepoffload.op_builder flags``. Other builds of the core
(tests/native/build_and_run.sh) use its output to get exactly the flags and features of the JIT build instead of
probing again.

    flags              three lines: ``cflags: ...``, ``ldflags: ...``, ``engines: ...``
    flags --cflags     only the compile flags, shell-quoted on one line (likewise --ldflags, --engines)
    flags --warnings   only the warning flags every build of the core uses (for a cross-compiler the probes do not
                       run with, e.g. tests/native/build_windows.sh)
    flags --without P  as if probe P (libaio, io_pgetevents, liburing) had failed: a build without that feature
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .async_io import AsyncIOBuilder
from .builder import CXX_PROBE, WARNING_FLAGS
from .probes import ProbeResult


def _flags(args: argparse.Namespace) -> int:
    if args.warnings:
        print(shlex.join(WARNING_FLAGS))
        return 0
    builder = AsyncIOBuilder()
    results = builder.probe_results()
    unknown = [name for name in args.without if name not in results or name == CXX_PROBE.name]
    if unknown:
        optional = sorted(set(results) - {CXX_PROBE.name})
        print(f"--without: unknown probe {', '.join(unknown)}; choose from {', '.join(optional)}", file=sys.stderr)
        return 2
    for name in args.without:
        results[name] = ProbeResult(name, False, "left out with --without")
    if not results[CXX_PROBE.name].ok:
        print(f"no working C++ compiler: {results[CXX_PROBE.name].reason}", file=sys.stderr)
        return 1
    cflags, ldflags = builder.build_flags(results)
    parts = {
        "cflags": shlex.join(cflags),
        "ldflags": shlex.join(ldflags),
        "engines": " ".join(builder.engines(results)),
    }
    chosen = [key for key in parts if getattr(args, key)]
    if len(chosen) == 1:
        print(parts[chosen[0]])
    else:
        for key in chosen or parts:
            print(f"{key}: {parts[key]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs ``python -m op_builder`` with ``argv`` (default: ``sys.argv[1:]``).

    Args:
        argv: The command line after the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit status: 0 on success, 1 without a working C++ compiler, 2 for an unknown ``--without`` probe.
    """
    parser = argparse.ArgumentParser(prog="python -m op_builder", description="Facts of the async-IO op's build.")
    commands = parser.add_subparsers(dest="command", required=True)
    flags = commands.add_parser("flags", help="compile and link flags the probes choose here")
    flags.add_argument("--cflags", action="store_true", help="print the compile flags")
    flags.add_argument("--ldflags", action="store_true", help="print the link flags")
    flags.add_argument("--engines", action="store_true", help="print the engines such a build contains, best first")
    flags.add_argument("--warnings", action="store_true", help="print only the warning flags (no probing)")
    flags.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="PROBE",
        help="treat this probe as failed (repeatable): libaio, io_pgetevents, liburing",
    )
    args = parser.parse_args(argv)
    return _flags(args)


if __name__ == "__main__":
    sys.exit(main())
