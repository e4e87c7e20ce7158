"""The crash-point harness's server: ``python runner.py '<json request>'`` prints one JSON result per kill.

The request: ``{"scenarios": [...], "base": folder, "points": "all" | K, "random": R, "seed": S}`` (K: that many
points spread evenly over the boundaries; R: kills at random times). For each scenario this process (which imports
torch once, then only forks) makes the reference checkpoints: "old" (``act`` run once in a fresh folder) and "new"
(``act`` run again on a copy of it), counting the boundaries the second run crosses: every ``os.replace``/
``os.rename``/``os.fsync``/``os.unlink``, every path opened by ``open`` for writing (just after it is truncated: a
file rewritten in place, as ``config.save_pretrained`` does, is empty there) and every write submitted to the async-IO
op (replaced files of any size are
freed in the background, as large ones are). Then for each kill point N (and K random times
within the clean run's duration) on a fresh copy of "old": a child runs ``act`` and is SIGKILLed just before its
Nth boundary; a second child loads what is there and says whether it is entirely "old", entirely "new", or neither;
a third runs ``act`` again to completion (the next successful save) and the listing of the folder must then equal
the clean "new" one's: nothing left behind.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import random
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import SCENARIOS, listing, same  # noqa: E402

BOUNDARIES = ("replace", "rename", "fsync", "unlink")


def interpose(kill_at: int, counter: list[int], action=None) -> None:
    """Count boundaries in this (child) process; SIGKILL it just before the ``kill_at``-th (0: never), or call
    ``action()`` there instead when given (the two-writer harness pauses the writer)."""

    def boundary() -> None:
        counter[0] += 1
        if counter[0] == kill_at:
            if action is None:
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                action()

    def wrap(function):
        def wrapper(*args, **kwargs):
            boundary()
            return function(*args, **kwargs)

        return wrapper

    for name in BOUNDARIES:
        setattr(os, name, wrap(getattr(os, name)))
    opener = builtins.open

    def counted_open(file, mode="r", *args, **kwargs):  # a path opened to be rewritten is empty from here on
        handle = opener(file, mode, *args, **kwargs)
        if "w" in mode and isinstance(file, (str, bytes, os.PathLike)):
            boundary()
        return handle

    builtins.open = io.open = counted_open
    from deepoffload.io import retire

    retire.RETIRE_MIN_BYTES = 0  # every replaced file is held open and freed by the background thread's close
    from deepoffload.io.handle import AsyncIOHandle

    submit = AsyncIOHandle._submit

    def counted_submit(self, write, *args, **kwargs):
        if write:
            boundary()
        return submit(self, write, *args, **kwargs)

    AsyncIOHandle._submit = counted_submit


def in_child(work, result: Path | None = None) -> int:
    """Run ``work()`` in a forked child; its return value (JSON) goes to ``result``; return the wait status."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            value = work()
            if result is not None:
                result.write_text(json.dumps(value))
            import atexit

            atexit._run_exitfuncs()  # what a normal exit does (e.g. removing swap folders), then no more
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def verdict(scenario: str, work: Path, old: Path, new: Path) -> str:
    """In a child: "old", "new", "mixed" or "raised: ..." for what ``work`` holds."""
    load = SCENARIOS[scenario][1]

    def check() -> str:
        try:
            got = load(work)
        except Exception as e:
            return f"raised: {type(e).__name__}: {e}"
        if same(got, load(old)):
            return "old"
        if same(got, load(new)):
            return "new"
        return "mixed"

    result = work.parent / f"{work.name}.verdict"
    status = in_child(check, result)
    if status != 0:
        return f"checker died (status {status})"
    return json.loads(result.read_text())


def run(request: dict) -> None:
    base = Path(request["base"])
    rng = random.Random(request.get("seed", 0))
    for scenario in request["scenarios"]:
        act = SCENARIOS[scenario][0]
        old, new = base / f"{scenario}-old", base / f"{scenario}-new"
        old.mkdir()
        if in_child(lambda: act(old, 1)) != 0:
            raise RuntimeError(f"{scenario}: the first save failed")
        shutil.copytree(old, new, symlinks=True)
        counts = base / f"{scenario}.count"

        def counted():
            counter = [0]
            interpose(0, counter)
            started = time.monotonic()
            act(new, 2)
            return [counter[0], time.monotonic() - started]

        if in_child(counted, counts) != 0:
            raise RuntimeError(f"{scenario}: the clean second save failed")
        total, seconds = json.loads(counts.read_text())
        clean = listing(new)
        points = (
            list(range(1, total + 1))
            if request["points"] == "all"
            else sorted({1 + (total * (2 * i + 1)) // (2 * request["points"]) for i in range(request["points"])})
        )
        kills = [("point", p) for p in points] + [
            ("after", round(rng.uniform(0, seconds), 4)) for _ in range(request.get("random", 0))
        ]
        for i, (kind, at) in enumerate(kills):
            work = base / f"{scenario}-{i}"
            shutil.copytree(old, work, symlinks=True)

            def killed(kind=kind, at=at, work=work):
                if kind == "point":
                    interpose(at, [0])
                else:
                    import threading

                    threading.Timer(at, os.kill, (os.getpid(), signal.SIGKILL)).start()
                act(work, 2)

            status = in_child(killed)
            was_killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            after_kill = verdict(scenario, work, old, new)
            if in_child(lambda work=work: act(work, 2)) != 0:
                after_next = "the next save failed"
            else:
                after_next = verdict(scenario, work, old, new)
            print(
                json.dumps(
                    {
                        "scenario": scenario,
                        "kind": kind,
                        "at": at,
                        "total": total,
                        "killed": was_killed,
                        "after_kill": after_kill,
                        "after_next": after_next,
                        "left_behind": sorted(set(listing(work)) - set(clean)),
                        "missing": sorted(set(clean) - set(listing(work))),
                    }
                ),
                flush=True,
            )
            shutil.rmtree(work)


def preload() -> None:
    """Import what the children use (modules only: no handle, no thread), so each fork starts ready."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401

    import deepoffload.checkpoint.api  # noqa: F401
    import deepoffload.dcp  # noqa: F401
    import deepoffload.formats  # noqa: F401
    import deepoffload.swap.optimizer  # noqa: F401
    import deepoffload.swap.params  # noqa: F401
    from deepoffload.io.native import native

    native()  # loads the op's library (built once); its threads start with the first handle, in a child


if __name__ == "__main__":
    torch.set_num_threads(1)  # children fork from here: no thread pool may exist
    preload()
    run(json.loads(sys.argv[1]))
