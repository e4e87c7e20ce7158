"""Fixtures of the reliability suite: the engines that work here, a small filesystem that fills up (root only),
open-descriptor counts and a helper that runs Python code in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest


@pytest.fixture(scope="session")
def engines(aio) -> list[str]:
    """Every compiled-in engine whose runtime self-test passes here, best first."""
    from deepoffload.io.native import engine_status

    usable = [engine for engine, (ok, _) in engine_status().items() if ok]
    assert usable, "no engine works here: the op's own self-test failed"
    return usable


def open_fds() -> int:
    """Descriptors this process has open now."""
    return len(os.listdir("/proc/self/fd"))


def _run(command: list[str], what: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise OSError(f"{what} failed: {' '.join(command)}: {proc.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Callable[..., Path]]:
    """A factory mounting a small filesystem: ``small_fs(nbytes, kind)`` with kind ``"ext4"`` (a loop-mounted
    image, accepts O_DIRECT) or ``"tmpfs"`` (buffered IO only). Unmounted after the test. Needs root: skipped
    with the reason otherwise, or when this machine cannot mount (no loop devices, in a container)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mounts: list[Path] = []

    def mount(nbytes: int, kind: str = "ext4") -> Path:
        point = tmp_path / f"mnt-{len(mounts)}"
        point.mkdir()
        try:
            if kind == "tmpfs":
                _run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(point)], "mounting a tmpfs")
            else:
                image = tmp_path / f"fs-{len(mounts)}.img"
                with open(image, "wb") as f:
                    f.truncate(nbytes)
                # no journal, no reserved blocks: the free space is (nearly) all usable and fills predictably
                _run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", str(image)], "mkfs.ext4")
                _run(["mount", "-o", "loop", str(image), str(point)], "loop-mounting an ext4 image")
        except (OSError, FileNotFoundError) as e:
            pytest.skip(f"cannot mount a small {kind} here: {e}")
        mounts.append(point)
        return point

    yield mount
    for point in reversed(mounts):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def fill(folder: Path, leave_bytes: int) -> Path:
    """Write a filler file in ``folder`` so that about ``leave_bytes`` bytes stay free; return its path (delete
    it to free the space)."""
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    filler = folder / f"filler-{uuid.uuid4().hex}"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
    return filler


@pytest.fixture
def run_python(aio) -> Callable[..., subprocess.CompletedProcess]:
    """Run ``code`` in a fresh interpreter (same environment, the op already built); ``prefix`` is prepended to
    the command (e.g. ``setpriv`` to drop a capability). Returns the finished process."""

    def run(code: str, *, prefix: tuple[str, ...] = (), timeout: float = 120,
            env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, sys.executable, "-c", code, *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})})

    return run
