"""The two-writer harness: ``python two_writers.py '<json request>'`` prints one JSON result per pause point.

The request: ``{"scenarios": [...], "base": folder, "points": "all" | K}`` (K: that many points spread evenly over
the boundaries). For each scenario of ``scenarios.py`` this process (which imports torch once, then only forks) makes
three reference checkpoints: v1 (the folder's checkpoint before the overlap), v2 (what writer B saves) and v3 (what
writer A saves), and counts the boundaries B's save crosses (every rename, fsync, unlink, file opened for writing and
write submitted to the op, as ``runner.py`` counts them). Then for each pause point N, on a fresh copy of v1:

1. B (a child) runs ``act(work, 2)`` and stops just before its Nth boundary: it stays alive, blocked on a pipe, so
   what it wrote so far belongs to a live writer;
2. A (another child) runs ``act(work, 3)`` to its end, or until it waits for the folder's lock that B holds (the lock
   module's ``_wait`` is patched to say so);
3. a checker loads the folder: it must be v1, v2 or v3 entire ("middle");
4. B is resumed; both saves must succeed; the folder must then load as the version whose switch came last (the
   rename onto the file that names the checkpoint: an index, ``model.safetensors``, ``.metadata`` or the file saved;
   each writer logs its version after each such rename) and hold exactly the files a clean save leaves.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from runner import in_child, interpose, preload  # noqa: E402
from scenarios import SCENARIOS, listing, same  # noqa: E402

# the renames that switch readers to a new checkpoint
SWITCHES = ("model.safetensors.index.json", "model.safetensors", ".metadata", "ckpt.pt", "ckpt.safetensors")


def log_switches(version: int, log: Path) -> None:
    """In a writer: append ``version`` to ``log`` after each rename onto a switch file (after the rename returns)."""
    replace = os.replace

    def logged(source, target, *args, **kwargs):
        replace(source, target, *args, **kwargs)
        if os.path.basename(os.fspath(target)) in SWITCHES:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, f"{version}\n".encode())
            finally:
                os.close(fd)

    os.replace = logged


def announce_lock_waits(fd: int) -> None:
    """In writer A: write one byte to ``fd`` when it first waits for a folder lock (if the library has one)."""
    try:
        from deepoffload.io import folder_lock
    except ImportError:
        return
    wait, told = folder_lock._wait, []

    def announced(seconds: float) -> None:
        if not told:
            told.append(True)
            os.write(fd, b"w")
        wait(seconds)

    folder_lock._wait = announced


def verdict(scenario: str, work: Path, references: dict[str, Path]) -> str:
    """In a child: the name of the reference ``work`` loads equal to, or "mixed", or "raised: ...".

    Args:
        scenario: The scenario's name.
        work: The folder to load.
        references: Name -> a folder holding that reference checkpoint.

    Returns:
        The verdict.
    """
    load = SCENARIOS[scenario][1]

    def check() -> str:
        from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)

        try:
            got = load(work)
        except (Exception, CheckpointException) as e:
            return f"raised: {type(e).__name__}: {e}"
        for name, folder in references.items():
            if same(got, load(folder)):
                return name
        return "mixed"

    result = work.parent / f"{work.name}.verdict"
    status = in_child(check, result)
    if status != 0:
        return f"checker died (status {status})"
    return json.loads(result.read_text())


def start(work) -> int:
    """Fork a child that runs ``work()`` and exits (0 when it returned, 3 when it raised); return its pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work()
            import atexit

            atexit._run_exitfuncs()
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(code)
    return pid


def exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def overlap(scenario: str, work: Path, pause_at: int, references: dict[str, Path]) -> dict:
    """Run B paused at its ``pause_at``-th boundary and A to its end (or its lock wait) on ``work``; see the module
    docstring."""
    act = SCENARIOS[scenario][0]
    log = work.parent / f"{work.name}.switches"
    paused_r, paused_w = os.pipe()
    resume_r, resume_w = os.pipe()

    def writer_b() -> None:
        os.close(paused_r)
        os.close(resume_w)

        def pause() -> None:
            os.write(paused_w, b"p")
            os.read(resume_r, 1)

        interpose(pause_at, [0], pause)
        log_switches(2, log)
        act(work, 2)

    b = start(writer_b)
    os.close(paused_w)
    os.close(resume_r)
    paused = os.read(paused_r, 1) == b"p"  # b"": B ended without reaching the point
    os.close(paused_r)
    waiting_r, waiting_w = os.pipe()

    def writer_a() -> None:
        os.close(waiting_r)
        os.close(resume_w)
        announce_lock_waits(waiting_w)
        interpose(0, [0])  # counts nothing, but frees replaced files as B's writes do
        log_switches(3, log)
        act(work, 3)

    a = start(writer_a)
    os.close(waiting_w)
    a_waited = os.read(waiting_r, 1) == b"w"  # b"": A ended (its end of the pipe closed) without waiting
    os.close(waiting_r)
    middle = verdict(scenario, work, references)
    os.write(resume_w, b"r")
    os.close(resume_w)
    b_code, a_code = exit_code(b), exit_code(a)
    switches = log.read_text().split() if log.exists() else []
    last = {"2": "v2", "3": "v3"}.get(switches[-1] if switches else "", "none")
    return {
        "scenario": scenario,
        "at": pause_at,
        "paused": paused,
        "a_waited": a_waited,
        "middle": middle,
        "b_exit": b_code,
        "a_exit": a_code,
        "switches": switches,
        "last_switch": last,
        "end": verdict(scenario, work, references),
    }


def run(request: dict) -> None:
    base = Path(request["base"])
    for scenario in request["scenarios"]:
        act = SCENARIOS[scenario][0]
        references = {name: base / f"{scenario}-{name}" for name in ("v1", "v2", "v3")}
        references["v1"].mkdir()
        if in_child(lambda: act(references["v1"], 1)) != 0:
            raise RuntimeError(f"{scenario}: the first save failed")
        counts = base / f"{scenario}.count"
        for version in (2, 3):
            folder = references[f"v{version}"]
            shutil.copytree(references["v1"], folder, symlinks=True)

            def counted(folder=folder, version=version):
                counter = [0]
                interpose(0, counter)
                act(folder, version)
                return counter[0]

            if in_child(counted, counts) != 0:
                raise RuntimeError(f"{scenario}: the clean save of v{version} failed")
            if version == 2:
                total = json.loads(counts.read_text())
        clean = listing(references["v2"])
        points = (
            list(range(1, total + 1))
            if request["points"] == "all"
            else sorted({1 + (total * (2 * i + 1)) // (2 * request["points"]) for i in range(request["points"])})
        )
        for i, point in enumerate(points):
            work = base / f"{scenario}-{i}"
            shutil.copytree(references["v1"], work, symlinks=True)
            started = time.monotonic()
            result = overlap(scenario, work, point, references)
            result.update(
                total=total,
                seconds=round(time.monotonic() - started, 2),
                left_behind=sorted(set(listing(work)) - set(clean)),
                missing=sorted(set(clean) - set(listing(work))),
            )
            print(json.dumps(result), flush=True)
            shutil.rmtree(work)


if __name__ == "__main__":
    torch.set_num_threads(1)  # children fork from here: no thread pool may exist
    preload()
    run(json.loads(sys.argv[1]))
