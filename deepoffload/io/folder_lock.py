"""An advisory lock on a checkpoint folder, held by a save while it switches the folder to its files and cleans up.

Why a lock, and why only there. A save into a folder first writes its files where no reader looks (temporaries, or
data files that no index or ``.metadata`` names yet), then switches readers to them with one rename, then removes
the files no longer named. The removal is what two overlapping saves used to turn against each other: each one's
cleaning took the other's files for leftovers. The rules that make it safe:

1. Files written before the switch carry their writer in their name (``deepoffload.io.owners``: pid, start time,
   host) or are covered by such a marker file, and cleaning never removes them while that writer may still run.
2. The switch and the cleaning after it run under this lock, so while a save cleans, no other switch can happen: the
   files the folder's current switch names are exactly the ones it just put in place, and it keeps those. Every
   other file of the checkpoint's names is then superseded, or left by a writer that died (or failed), never one a
   live save still needs.

So at every moment the folder holds every file its last switch names (no cleaning removes them before a later
switch replaces it), and when overlapping saves end, the one that switched last is what loads. The lock is held for
renames, fsyncs and unlinks only (never while tensors are written), so a second save waits briefly; waiting longer
than ``TIMEOUT_S`` means the holder is stuck (stopped, or on a hung filesystem), and the waiter raises
``TimeoutError`` naming the folder and the holder's process id instead of waiting for ever. Lock-free designs (every
save keeps what a live writer might still switch to) were considered: deciding "superseded" without a lock needs the
folder's current switch to stay put while it is read, which is this lock again.

The lock is ``flock`` on the file ``.deepoffload.lock`` in the folder: the kernel releases it when its holder's
process ends, even killed, so a dead holder never blocks anyone. The holder writes its process token into the file
and removes the file before releasing the lock; a waiter that then obtains the lock on the removed file sees that
the path no longer names it and tries again, so one holder at a time holds the lock of the file the path names.
Without ``fcntl`` (Windows), or on a filesystem that refuses ``flock`` (Lustre mounted ``noflock``: ``ENOSYS``),
no lock is taken: overlapping saves into one folder are not protected there (on such a filesystem each save warns).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
import warnings
from pathlib import Path
from typing import Iterator

from .owners import host_id, is_alive, new_file_mode, process_token

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".deepoffload.lock"
TIMEOUT_S = 300.0  # seconds a save waits for another save's switch before giving up (the switch takes far less)
_POLL_S = (0.001, 0.05)  # the first and the longest pause between tries
_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK}  # a filesystem without flock
_NOT_OURS = "no save of this library made it: remove it, then save again"


def _wait(seconds: float) -> None:
    """Pause between two tries to take a lock (the two-writer crash harness patches it to see a save wait)."""
    time.sleep(seconds)


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, timeout: float | None = None) -> Iterator[None]:
    """Hold ``folder``'s save lock for the ``with`` block (see the module docstring).

    Not re-entrant: a thread that holds a folder's lock and asks for it again waits until ``timeout``.

    Args:
        folder: The checkpoint folder (it must exist).
        timeout: Seconds to wait for another holder at most (default ``TIMEOUT_S``).

    Yields:
        Nothing; the lock is held until the block ends.

    Raises:
        TimeoutError: When another save holds the lock for longer than ``timeout``; the message names the folder
            and the holder's process id.
        OSError: When the lock file cannot be created or opened (the message names it).
    """
    if fcntl is None:
        yield
        return
    path = Path(folder) / LOCK_NAME
    fd = _acquire(path, TIMEOUT_S if timeout is None else timeout)
    if fd is None:  # the filesystem has no flock: the save goes on unprotected (it warned)
        yield
        return
    try:
        yield
    finally:
        try:  # removed while held, so a waiter holding the removed file's lock knows to try again
            # (not removable: another user's file in a sticky folder; it stays, and still works as the lock file)
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                    os.unlink(path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # (a forked child may share the descriptor: release explicitly)
            os.close(fd)


def _open(path: Path) -> int:
    """Open (or create) the lock file ``path``: a regular file, never through a link, without blocking."""
    flags = os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(path, os.O_RDWR | flags, new_file_mode())
        except PermissionError:  # another user's lock file (in a shared folder): reading is enough to lock it
            try:
                fd = os.open(path, os.O_RDONLY | flags)
            except PermissionError:  # fs.protected_regular refuses O_CREAT on it in a sticky folder: it exists
                fd = os.open(path, os.O_RDONLY | (flags & ~os.O_CREAT))
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):
            kind = "a symbolic link" if e.errno == errno.ELOOP else "a folder"
            reason = f"{kind} is in its place ({_NOT_OURS})"
        else:
            reason = e.strerror or str(e)
        raise OSError(e.errno, f"cannot take the save lock of {path.parent}: {path}: {reason}", str(path)) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(
            errno.EINVAL,
            f"cannot take the save lock of {path.parent}: {path} is not a regular file ({_NOT_OURS})",
            str(path),
        )
    return fd


def _acquire(path: Path, timeout: float) -> int | None:
    """Take the lock of the file at ``path`` (see the module docstring).

    Args:
        path: The lock file.
        timeout: Seconds to wait for another holder at most.

    Returns:
        The locked file's descriptor; None (after a warning, the file removed) where the filesystem does not
        support ``flock``.

    Raises:
        TimeoutError: When another holder keeps the lock for longer than ``timeout``.
        OSError: When the file cannot be opened or locked.
    """
    deadline = time.monotonic() + timeout
    pause = _POLL_S[0]
    fd = _open(path)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(_busy_message(path, fd, timeout)) from None
                _wait(pause)
                pause = min(2 * pause, _POLL_S[1])
                continue
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    raise
                _unsupported(path, fd, e)
                return None
            try:
                current = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                current = None
            if current is not None and os.path.samestat(os.fstat(fd), current):
                break
            os.close(fd)  # the previous holder removed the file: lock the one the path names now
            fd = -1
            fd = _open(path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    with contextlib.suppress(OSError):  # who holds it, for a waiter's message (not writable: another user's file)
        os.ftruncate(fd, 0)
        os.pwrite(fd, process_token().encode(), 0)
    return fd


def _unsupported(path: Path, fd: int, error: OSError) -> None:
    """Warn that ``path``'s filesystem refuses ``flock``; close ``fd`` and remove the file (it locks nothing there)."""
    with contextlib.suppress(OSError):
        if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
            os.unlink(path)
    os.close(fd)
    warnings.warn(
        f"saving into {path.parent} without its save lock: its filesystem refuses flock ({error.strerror or error}). "
        f"Saves into this folder must not overlap here (a save's cleaning can remove another's files); mount it "
        f"with flock support (Lustre: -o flock) or give overlapping saves separate folders",
        UserWarning,
        stacklevel=5,
    )


def _busy_message(path: Path, fd: int, timeout: float) -> str:
    """What a save that waited ``timeout`` seconds for the lock file ``path`` (open as ``fd``) says."""
    try:
        token = os.pread(fd, 100, 0).decode("ascii", errors="replace").strip()
    except OSError:
        token = ""
    pid, start, host = (token.split(".") + ["", ""])[:3]
    if pid.isdigit() and start.isdigit() and (host != host_id() or is_alive(int(pid), int(start))):
        holder = f"process {pid} (its record: {token})"
    else:  # the record is an earlier holder's, that has ended: this holder could not write the file (another user's)
        holder = "another process (it could not record its id in the lock file)"
    return (
        f"cannot save into {path.parent}: another save into this folder, by {holder}, held its lock {path} for "
        f"all the {timeout:g} s this save waited. Saves into one folder take turns; if that process is stopped or "
        f"hung, end it (the lock goes with it) or save into another folder"
    )
