"""Run a child process under a hard memory limit (a memory cgroup), to prove a workload fits in that much memory.

cgroup v1 (a ``memory`` hierarchy): a child group is made under this process's own group (from ``/proc/self/cgroup``)
with ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``, so swap is no way out). cgroup v2: the same
with ``memory.max`` and ``memory.swap.max``, where the parent group lets the memory controller be enabled. The child
joins the group before it runs the command (a shell writes its own pid into ``cgroup.procs``, then execs), and the
group is removed afterwards. ``unavailable()`` says why none can be made (not root, no memory controller, ...), for
``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass
class LimitedRun:
    """What a confined child did: its exit status (negative: killed by that signal), output, the group's peak
    memory in bytes (None where the kernel does not report it) and how many processes the limit's OOM killer
    killed."""

    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int | None
    oom_kills: int


def _own_groups() -> dict[str, str]:
    """controller (or '' for v2) -> this process's cgroup path."""
    groups = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            groups[controller] = path
    return groups


def _v2_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            return Path(fields[0].split()[4])
    return None


def _parent_group() -> tuple[str, Path]:
    """('v1' or 'v2', the folder under which a child group can be made); raises OSError saying why not."""
    if os.name != "posix" or not Path("/proc/self/cgroup").exists():
        raise OSError("memory cgroups need Linux")
    if os.geteuid() != 0:
        raise OSError("making a memory cgroup needs root")
    groups = _own_groups()
    if "memory" in groups:
        parent = Path("/sys/fs/cgroup/memory") / groups["memory"].lstrip("/")
        if not (parent / "memory.limit_in_bytes").exists():
            raise OSError(f"the cgroup v1 memory hierarchy is not mounted at {parent}")
        return "v1", parent
    mount = _v2_mount()
    if mount is None or "" not in groups:
        raise OSError("no cgroup v1 memory controller and no cgroup v2 hierarchy")
    parent = mount / groups[""].lstrip("/")
    if "memory" not in (parent / "cgroup.controllers").read_text().split():
        raise OSError(f"cgroup v2: the memory controller is not available in {parent}")
    control = parent / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        try:
            control.write_text("+memory")
        except OSError as e:  # a group holding processes cannot enable controllers for its children
            raise OSError(f"cgroup v2: cannot enable the memory controller below {parent}: {e.strerror}") from None
    return "v2", parent


def unavailable() -> str | None:
    """None when ``run_limited`` can work here, else the reason it cannot."""
    try:
        _, parent = _parent_group()
        probe = parent / f"deepoffload-probe-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"no memory cgroup can be made here: {e.strerror or e}"
    return None


class MemoryCgroup:
    """A memory-limited cgroup that exists inside a ``with`` block."""

    def __init__(self, limit_bytes: int):
        self.version, parent = _parent_group()
        self.limit_bytes = limit_bytes
        self.path = parent / f"deepoffload-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> "MemoryCgroup":
        self.path.mkdir()
        try:
            if self.version == "v1":
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
                with contextlib.suppress(FileNotFoundError):  # absent when swap accounting is off
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit_bytes))
            else:
                (self.path / "memory.max").write_text(str(self.limit_bytes))
                with contextlib.suppress(FileNotFoundError):
                    (self.path / "memory.swap.max").write_text("0")
        except BaseException:
            self.path.rmdir()
            raise
        return self

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def peak_bytes(self) -> int | None:
        value = self._read("memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak")
        return int(value) if value else None

    def oom_kills(self) -> int:
        text = self._read("memory.oom_control" if self.version == "v1" else "memory.events") or ""
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # kill what the child left behind (its own processes only), then remove the group
            pids = [int(p) for p in (self._read("cgroup.procs") or "").split()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        self.path.rmdir()


def run_limited(
    argv: Sequence[str],
    limit_bytes: int,
    *,
    timeout: float = 600,
    env: dict | None = None,
    cwd: str | os.PathLike | None = None,
) -> LimitedRun:
    """Run ``argv`` confined to ``limit_bytes`` of memory (its page cache counts too under v1); return what it did.
    Raises OSError where no memory cgroup can be made (see ``unavailable``)."""
    with MemoryCgroup(limit_bytes) as group:
        procs = str(group.path / "cgroup.procs")
        command = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        return LimitedRun(proc.returncode, proc.stdout, proc.stderr, group.peak_bytes(), group.oom_kills())
