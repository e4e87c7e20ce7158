"""The on-disk cache (probe results, JIT builds) and the lock that lets many processes share it.

The lock is ``fcntl.flock`` on a file next to the build directory: the kernel drops it when its holder dies, so a
builder killed mid-build never makes later processes wait (torch's own ``lock`` file does; we remove that one while we
hold ours, since nobody else can be building then).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from . import env

CACHE_ENV = "DEEPOFFLOAD_CACHE_DIR"


def cache_root() -> Path:
    """``$DEEPOFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/deepoffload``, else ``~/.cache/deepoffload``."""
    explicit = env.get_path(CACHE_ENV)
    if explicit is not None:
        return explicit
    return (env.get_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepoffload"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old file or the whole new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def exclusive_lock(path: Path, on_wait=None) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the ``with`` body.

    The lock dies with its holder, so there is no stale lock to recover from.

    Args:
        path: The lock file (created, with its folder, if missing; it then holds the holder's pid).
        on_wait: Called once (no arguments) if another process holds the lock, before waiting for it.

    Yields:
        Nothing: the body runs while the lock is held.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if sys.platform == "win32":
        with _windows_lock(path, on_wait):
            yield
        return
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)  # closing drops the flock


@contextlib.contextmanager
def _windows_lock(path: Path, on_wait) -> Iterator[None]:
    if sys.platform != "win32":  # also tells mypy, which checks for the platform it runs on, that msvcrt is there
        raise OSError(
            errno.ENOTSUP,
            f"the msvcrt lock is Windows' only, this is {sys.platform} (exclusive_lock uses flock here)",
            str(path),
        )
    import msvcrt

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waited = False
        while True:
            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
                break
            except OSError:
                if not waited and on_wait is not None:
                    on_wait()
                waited = True
                time.sleep(0.2)
        yield
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    finally:
        os.close(fd)
