"""Replacing a large file without waiting for its old blocks to be freed.

Renaming a new file over an old one makes the kernel free the old file's blocks inside the rename when nothing else
holds it (on ext4 about 0.1 s per GB, a third of a durable 1 GB write on a fast disk). ``replace`` holds the old file
open across the rename, so the rename only removes its name, and closes it on a background thread: the blocks are
freed there, by that last close, while the caller goes on. What is durable does not change: the new file is in place
when ``replace`` returns, exactly as after ``os.replace``.

Nothing is left on disk in any case: until the thread closes it the old file has no name, only this process's
descriptor, and a process that ends (even killed) closes its descriptors, which frees the file. Its bytes take their
space until then. A normal exit waits for the thread (it is not a daemon, and an ``atexit`` handler waits too).
Where the file cannot be opened for reading, has other links, or on Windows (which refuses to rename over an open
file), ``replace`` is ``os.replace``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import stat
import threading

RETIRE_MIN_BYTES = 64 << 20  # smaller files are freed quickly enough inside the rename
_pending: set[threading.Thread] = set()
_pending_lock = threading.Lock()


def replace(source: str, target: str) -> None:
    """Rename ``source`` over ``target`` like ``os.replace``, freeing a large replaced file in the background.

    Args:
        source: The new file (in the same folder as ``target``).
        target: The path it takes; an existing regular file there is replaced.

    Raises:
        OSError: When the rename fails (as ``os.replace`` raises it); ``target`` is then left as it was.
    """
    held = _hold(target)
    try:
        os.replace(source, target)
    except BaseException:
        if held is not None:
            os.close(held)
        raise
    if held is not None:
        _close_later(held)


def wait() -> None:
    """Wait until every old file handed to the background has been freed."""
    with _pending_lock:
        threads = list(_pending)
    for thread in threads:
        thread.join()


atexit.register(wait)  # a process leaving through atexit alone (a forked worker's os._exit after it) frees them too


def _hold(target: str) -> int | None:
    """A read descriptor of ``target`` when it is a large regular file with no other link, or None."""
    if os.name == "nt":
        return None
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # no such file, not readable, a link: the rename frees it
        return None
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_size < RETIRE_MIN_BYTES:
        os.close(fd)
        return None
    return fd


def _close_later(fd: int) -> None:
    thread = threading.Thread(target=_close, args=(fd,), name="deepoffload-retire")
    with _pending_lock:
        _pending.add(thread)
    try:
        thread.start()
    except RuntimeError:  # no new threads (interpreter shutdown): free it here
        with _pending_lock:
            _pending.discard(thread)
        _close_quietly(fd)


def _close(fd: int) -> None:
    try:
        _close_quietly(fd)
    finally:
        with _pending_lock:
            _pending.discard(threading.current_thread())


def _close_quietly(fd: int) -> None:
    # closing a read-only descriptor of a file that has no name left cannot lose data; it only frees the blocks
    with contextlib.suppress(OSError):
        os.close(fd)
