"""Every figure of the benchmarks page, refreshed by one command.

Runs each benchmark whose plot the docs site shows, one after the other, each writing its
``benchmarks/results/<name>.json`` (which ``mkdocs build`` draws as ``docs/assets/plots/<name>.png``), then
rebuilds the site unless ``--no-site``. Run it on an idle machine: each benchmark interleaves what it compares and
measures its own bound in the same run, but a second program on the machine still moves the ratios. A benchmark
that fails is reported and the others still run; the exit status is the number that failed.

    python benchmarks/figures.py --folder DIR                 # all of them (about 30 minutes here)
    python benchmarks/figures.py --folder DIR --only moe kv_cache
    python benchmarks/figures.py --list                      # the commands, without running them

``DIR`` is a folder on the disk to measure (not tmpfs). The benchmarks import the deepoffload of this checkout.
Figures that need root (throttled loop drives) are skipped with a message where the process is not root.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (the benchmark's arguments, "{folder}" for DIR, "{json}" for its results file; needs root; the other
# results files it writes beside its own, each drawn as its own plot)
FIGURES: dict[str, tuple[list[str], bool, tuple[str, ...]]] = {
    "engines_vs_fio": (["--path", "{folder}", "--size", "1G", "--rounds", "5", "--json", "{json}"], False, ()),
    "checkpoint": (["--path", "{folder}", "--size", "1G", "--rounds", "9", "--core", "--json", "{json}"], False, ()),
    "save_parts": (["--path", "{folder}", "--goal-only", "--rounds", "9", "--json", "{json}"], False, ()),
    "drives": (["--rounds", "2", "--json", "{json}"], True, ()),
    "optimizer_overlap": (
        ["--folder", "{folder}", "--models", "mlp", "--mlp-width", "2048", "--mlp-layers", "32", "--rounds", "5"]
        + ["--json", "{json}"],
        False,
        (),
    ),
    "hf_llama_stream": (["--folder", "{folder}", "--rounds", "2", "--json", "{json}"], False, ()),
    "codec": (["--folder", "{folder}", "--rounds", "2", "--tokens", "8", "--json", "{json}"], False, ("codec_curve",)),
    "activations": (
        ["--folder", "{folder}", "--width", "512", "--layers", "16", "--rows", "8192", "--rounds", "3"]
        + ["--json", "{json}"],
        False,
        (),
    ),
    "lora": (
        ["--folder", "{folder}", "--rounds", "3", "--steps", "3", "--layers", "8", "--seq", "16", "--json", "{json}"],
        False,
        (),
    ),
    "moe": (["--folder", "{folder}", "--rounds", "3", "--tokens", "24", "--json", "{json}"], False, ()),
    "kv_cache": (["--folder", "{folder}", "--rounds", "3", "--json", "{json}"], False, ()),
}


def command(name: str, folder: str) -> list[str]:
    """The command line that refreshes one figure.

    Args:
        name: A key of ``FIGURES``.
        folder: The folder on the disk to measure.

    Returns:
        The argument vector, run from the repository's root (``python`` is this interpreter).
    """
    arguments = FIGURES[name][0]
    json_path = f"benchmarks/results/{name}.json"
    return ["python", f"benchmarks/{name}.py", *(a.format(folder=folder, json=json_path) for a in arguments)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="a folder on the disk to measure")
    parser.add_argument("--only", nargs="+", choices=sorted(FIGURES), help="refresh these figures only")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    parser.add_argument("--no-site", action="store_true", help="do not run `mkdocs build --strict` afterwards")
    args = parser.parse_args()
    names = args.only or list(FIGURES)
    if args.list:
        for name in names:
            print(shlex.join(command(name, args.folder or "DIR")))
        return 0
    if args.folder is None:
        parser.error("--folder DIR is required (a folder on the disk to measure)")
    os.makedirs(args.folder, exist_ok=True)
    failed = []
    for name in names:
        if FIGURES[name][1] and os.geteuid() != 0:
            print(f"== {name}: skipped (needs root for throttled loop drives)", flush=True)
            continue
        load = os.getloadavg()[0]
        print(f"== {name} (load average {load:.2f}): {shlex.join(command(name, args.folder))}", flush=True)
        if load > 0.5 * (os.cpu_count() or 1):
            print(f"   warning: the machine is not idle (load {load:.2f}); the ratios may move", flush=True)
        start = time.monotonic()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        rc = subprocess.call([sys.executable, *command(name, args.folder)[1:]], cwd=REPO, env=env)
        print(f"== {name}: exit {rc} after {time.monotonic() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    if not args.no_site and not failed:
        subprocess.call([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=REPO)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
