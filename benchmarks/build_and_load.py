"""Cold JIT build time, warm load time and `deepoffload report` wall time, each in a fresh process.

    python benchmarks/build_and_load.py [--rounds 3]

Targets on a 2-core machine (DESIGN.md): cold build <= 20 s (the reference: 238 s), warm load <= 0.3 s after
`import torch` (the reference: 4.9 s), warm report <= 1.5 s (the reference: 3.9 s) and compiling nothing.
Rounds interleave cold build, warm load and report so machine noise hits all three alike; medians are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

WARM_LOAD = """
import time, torch
start = time.perf_counter()
from deepoffload.op_builder import AsyncIOBuilder
AsyncIOBuilder().load_native()
print(time.perf_counter() - start)
"""


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode not in (0,):
        raise SystemExit(f"{' '.join(cmd[:3])} failed: {proc.stderr[-2000:]}")
    return time.perf_counter() - start, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cold, warm, report = [], [], []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="deepoffload-bench-cache-") as cache:
            env = {**os.environ, "DEEPOFFLOAD_CACHE_DIR": cache}
            seconds, _ = timed([sys.executable, "-c", "from deepoffload.io.native import native; native()"], env)
            cold.append(seconds)
            _, out = timed([sys.executable, "-c", WARM_LOAD], env)
            warm.append(float(out.strip()))
            timed([sys.executable, "-m", "deepoffload", "report"], env)  # warms the self-test folder
            seconds, _ = timed([sys.executable, "-m", "deepoffload", "report"], env)
            report.append(seconds)
        print(
            f"round {r + 1}: cold build {cold[-1]:.1f} s, warm load {warm[-1] * 1000:.0f} ms, "
            f"report {report[-1]:.2f} s",
            flush=True,
        )
    print(
        f"median cold JIT build (process wall, incl. probes and import): {statistics.median(cold):.1f} s "
        f"(target <= 20 s; reference 238 s: {238 / statistics.median(cold):.1f}x faster)"
    )
    print(
        f"median warm load after import torch: {statistics.median(warm) * 1000:.0f} ms "
        f"(target <= 300 ms; reference 4.9 s)"
    )
    print(
        f"median warm `deepoffload report` wall time: {statistics.median(report):.2f} s "
        f"(target <= 1.5 s; reference 3.9 s)"
    )


if __name__ == "__main__":
    main()
