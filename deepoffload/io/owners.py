"""Files and folders that belong to one process, and the permission rules of a save.

Temporaries of a save and per-run swap folders (named and cleaned by ``deepoffload.swap.folders``) carry their
writer's process id and start time in their name (``process_token``, ``OWNER_PATTERN``), so that the next save or run
in the same place removes what a dead process left (a SIGKILL runs no cleanup) and never touches what a live one
still writes.

A process is judged only where it could be seen: the name also records a host id (this boot of this machine and
this process's pid namespace), and files of another host id (another machine sharing the folder, another container)
are left alone. A process is alive when its id exists and (where the system tells start times, Linux's ``/proc``) it
started at the recorded time; an id reused by a newer process is therefore dead for this purpose. Where the start
time cannot be read, an existing id counts as alive, and on Windows every id does: nothing is removed that might
still be in use.

Also the permission rules of a save: temporaries are created ``0600`` (readable by nobody else while written); the
file that replaces another takes the old one's mode (and owner, where the system allows); a new file gets the mode
that the umask gives a new file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import stat
import uuid
from pathlib import Path

PRIVATE_MODE = 0o600
OWNER_PATTERN = r"(?P<pid>\d+)\.(?P<start>\d+)\.(?P<host>[0-9a-f]{8})"  # what process_token() writes
_TEMPORARY = re.compile(rf"\.(?P<target>.+?)\.(?:tmp|partial)-{OWNER_PATTERN}-[0-9a-f]{{8}}.*")
_start_times: dict[int, int] = {}
_PID_MAX = 2**31 - 1  # process ids are C ints


def start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot, from ``/proc/<pid>/stat``), or 0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:  # no such process, or no /proc here: the start time is unknown (0 says so)
        return 0
    try:  # the command name (field 2) may hold spaces and parentheses: count fields after its last ')'
        return int(text[text.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):  # a stat line of another shape: unknown, as documented
        return 0


def host_id() -> str:
    """8 hex digits for this boot of this machine and this process's pid namespace: the processes it can see."""
    global _host
    if _host is None:
        parts = [socket.gethostname()]
        for read in (_boot_id, lambda: os.readlink("/proc/self/ns/pid")):
            try:
                parts.append(read())
            except OSError:  # not Linux, or /proc hidden: the host id is made of what can be read
                pass
        _host = hashlib.sha1("|".join(parts).encode()).hexdigest()[:8]
    return _host


_host: str | None = None


def _boot_id() -> str:
    """This boot's id from ``/proc`` (the file is closed before returning)."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        return f.read().strip()


def process_token() -> str:
    """``<pid>.<start time>.<host id>`` of this process (a forked child gets its own)."""
    pid = os.getpid()
    start = _start_times.get(pid)
    if start is None:
        start = _start_times[pid] = start_time(pid)
    return f"{pid}.{start}.{host_id()}"


def owner_alive(match: re.Match) -> bool:
    """Whether the owner a name records (``OWNER_PATTERN``'s groups) may still run: another host's always may.

    Args:
        match: A match of a pattern holding ``OWNER_PATTERN``.

    Returns:
        False only when that process ran on this host and is no longer alive.
    """
    return match["host"] != host_id() or is_alive(int(match["pid"]), int(match["start"]))


def is_alive(pid: int, start: int) -> bool:
    """Whether process ``pid`` of this host that started at ``start`` still runs (see the module docstring).

    Args:
        pid: The process id.
        start: Its start time as ``start_time`` reads it (0: unknown; then an existing id counts as alive).

    Returns:
        False when no such process runs (or the id was reused by a newer one); True otherwise, and always on Windows.
    """
    if pid <= 0 or pid > _PID_MAX:  # no such process (and os.kill would raise OverflowError for a crafted name)
        return False
    if os.name == "nt":  # os.kill(pid, 0) would terminate it there; without a safe check, count it alive
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # no such process: that is the answer
        return False
    except OSError:
        pass  # exists, owned by someone else
    if start == 0:
        return True
    now = start_time(pid)
    return now == 0 or now == start


def temporary_name(target: str, kind: str = "tmp") -> str:
    """A fresh hidden name for a temporary of the file (or set of files) named ``target``, owned by this process.

    Append a suffix to name several temporaries of one save.

    Args:
        target: The name (not the path) of the file saved.
        kind: ``"tmp"`` or ``"partial"`` (what ``remove_dead_temporaries`` recognises).

    Returns:
        ``.<target>.<kind>-<pid>.<start>.<host id>-<random>``.
    """
    return f".{target}.{kind}-{process_token()}-{uuid.uuid4().hex[:8]}"


def remove_dead_temporaries(folder: str | os.PathLike[str], target: str) -> list[Path]:
    """Remove the temporaries of ``target`` in ``folder`` left by processes that are no longer alive; return them.

    Best effort, for each leftover on its own: one that cannot be removed (another user's, a read-only folder) or
    that another process removes at the same moment is passed over, and the others are still removed; the save that
    asked goes on either way (its own temporary has a name of its own).

    Args:
        folder: Where the target lies.
        target: The name (not the path) of the file whose temporaries are looked for.

    Returns:
        The temporaries removed.
    """
    try:
        with os.scandir(folder) as listing:
            entries = list(listing)
    except OSError:  # no folder to clean (yet), or not readable: nothing to remove
        return []
    removed = []
    for entry in entries:
        match = _TEMPORARY.fullmatch(entry.name)
        if match is None or match["target"] != target or owner_alive(match):
            continue
        try:
            os.unlink(entry.path)
        except OSError:  # another user's, a read-only folder, or removed meanwhile: best effort (see docstring)
            continue
        removed.append(Path(entry.path))
    return removed


def create_private(path: str | os.PathLike) -> int:
    """Create the new file ``path`` readable and writable by its owner only; return a write descriptor."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), PRIVATE_MODE)


def new_file_mode() -> int:
    """The permission bits the umask gives a new file (``0666 & ~umask``).

    The umask is read without changing it where the system shows it (Linux 4.7+), else by setting it back at once.

    Returns:
        The mode bits.
    """
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def adopt_mode(temporary: str | os.PathLike, model: str | os.PathLike | None) -> None:
    """Give ``temporary`` the mode (and owner and group, where this process may set them) of the file it replaces.

    Args:
        temporary: The file about to replace ``model``.
        model: The file replaced; when None or missing, ``temporary`` gets the umask's mode for a new file.
    """
    try:
        old = os.stat(model) if model is not None else None
    except FileNotFoundError:
        old = None
    if old is None:
        os.chmod(temporary, new_file_mode())
        return
    if hasattr(os, "chown"):
        mine = os.stat(temporary)
        if (mine.st_uid, mine.st_gid) != (old.st_uid, old.st_gid):
            try:
                os.chown(temporary, old.st_uid, old.st_gid)
            except PermissionError:  # only root may give a file away; its group may still be one of ours
                with contextlib.suppress(PermissionError):
                    os.chown(temporary, -1, old.st_gid)
    os.chmod(temporary, stat.S_IMODE(old.st_mode))
