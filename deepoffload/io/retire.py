"""Replacing a large file without waiting for its old blocks to be freed.

Renaming a new file over an old one makes the kernel free the old file's blocks inside the rename when nothing else
holds it (on ext4 about 0.1 s per GB, a third of a durable 1 GB write on a fast disk). ``replace`` keeps the old file
alive for that moment under a hidden second name (a hard link, named like a save's temporary, with this process as
its owner), renames, and unlinks that name on a background thread, so the caller goes on while the blocks are freed.
What is durable does not change: the new file is in place when ``replace`` returns, exactly as after ``os.replace``.

Until the thread is done the old bytes still take their space, under ``.<name>.old-<owner>-...``. A process killed
before that leaves the name behind; the next save of that file removes it (``owners.remove_dead_temporaries``), and
the thread of a process that exits normally runs to its end first (it is not a daemon, and an ``atexit``
handler waits for it). Where hard links are not
possible (some filesystems) or the old file has other links, ``replace`` is ``os.replace``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import stat
import threading

from .owners import temporary_name

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
    retired = _link_aside(target)
    try:
        os.replace(source, target)
    except BaseException:
        if retired is not None:
            _unlink_quietly(retired)
        raise
    if retired is not None:
        _unlink_later(retired)


def wait() -> None:
    """Wait until every old file handed to the background has been removed."""
    with _pending_lock:
        threads = list(_pending)
    for thread in threads:
        thread.join()


atexit.register(wait)  # a process leaving through atexit alone (a forked worker's os._exit after it) frees them too


def _link_aside(target: str) -> str | None:
    """A second name for ``target`` when it is a large regular file with no other link, or None."""
    try:
        info = os.lstat(target)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_size < RETIRE_MIN_BYTES:
        return None
    folder, name = os.path.split(target)
    retired = os.path.join(folder, temporary_name(name, "old"))
    try:
        os.link(target, retired)
    except OSError:  # no hard links on this filesystem, or the file just went: the rename frees it
        return None
    return retired


def _unlink_later(path: str) -> None:
    thread = threading.Thread(target=_remove, args=(path,), name="deepoffload-retire")
    with _pending_lock:
        _pending.add(thread)
    try:
        thread.start()
    except RuntimeError:  # no new threads (interpreter shutdown): free it here
        with _pending_lock:
            _pending.discard(thread)
        _unlink_quietly(path)


def _remove(path: str) -> None:
    try:
        _unlink_quietly(path)
    finally:
        with _pending_lock:
            _pending.discard(threading.current_thread())


def _unlink_quietly(path: str) -> None:
    # a failure leaves a dead temporary behind, which the next save of the file removes
    with contextlib.suppress(OSError):
        os.unlink(path)
