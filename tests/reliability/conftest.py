"""Fixtures of the reliability suite: the engines that work here, open-descriptor counts, filling a small
filesystem (``small_fs`` itself lives in tests/conftest.py) and a helper that runs Python code in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture(scope="session")
def engines(aio) -> list[str]:
    """Every compiled-in engine whose runtime self-test passes here, best first."""
    from deepoffload.io.engines import engine_status

    usable = [engine for engine, (ok, _) in engine_status().items() if ok]
    assert usable, "no engine works here: the op's own self-test failed"
    return usable


def open_fds() -> int:
    """Descriptors this process has open now."""
    return len(os.listdir("/proc/self/fd"))


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

    def run(
        code: str,
        *,
        prefix: tuple[str, ...] = (),
        timeout: float = 120,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*prefix, sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )

    return run
