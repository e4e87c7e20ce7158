"""Who can reach a swap folder: a base folder another user controls is refused, a replaced run folder is detected.

Whoever may rename entries in the base folder can replace this run's folder with a link to a folder of theirs and
then read the swap files written there and change what is read back. That is the base folder's owner, root, and,
when the folder is writable by everyone without the sticky bit (``/tmp`` has it), everyone. ``check_base`` refuses a
base folder (or a link at its name) that gives that power to another user, unless the caller trusts them
(``SwapConfig(trust_folder_owner=True)``). The run folder is then opened without following links and checked to be
a folder of this user's, private (``0700``); its identity (device, inode) is recorded, and ``check_run_folder``,
called by every swap, refuses to go on once the name leads elsewhere. Swap files are created ``0600``.
"""

from __future__ import annotations

import errno
import os
import stat
import threading

_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_lock = threading.Lock()
_identities: dict[str, tuple[int, int]] = {}  # run folder -> (st_dev, st_ino) when it was made


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_base(base: str, trust_owner: bool) -> None:
    """Refuse ``base`` when another user could replace the run folders made in it (see the module docstring).

    Args:
        base: The base folder (existing).
        trust_owner: Accept it anyway (``SwapConfig(trust_folder_owner=True)``).

    Raises:
        PermissionError: Naming the folder (or link), its owner and mode, and what to do.
    """
    if trust_owner or not hasattr(os, "geteuid"):  # (Windows: no owners to compare here)
        return
    me = os.geteuid()
    trusted = (me, 0)
    link = os.lstat(base)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in trusted:
        raise PermissionError(
            errno.EACCES,
            _refusal(base, f"is a link owned by {_user(link.st_uid)}, who can point it elsewhere at any time"),
            base,
        )
    target = os.stat(base)
    mode = stat.S_IMODE(target.st_mode)
    if target.st_uid not in trusted:
        raise PermissionError(
            errno.EACCES,
            _refusal(base, f"is owned by {_user(target.st_uid)} (mode {mode:04o}), who can rename what is in it"),
            base,
        )
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise PermissionError(
            errno.EACCES, _refusal(base, f"is writable by every user without the sticky bit (mode {mode:04o})"), base
        )


def _refusal(base: str, why: str) -> str:
    return (
        f"swap folder {base} {why}: another user could replace this run's folder with a link to theirs and read or "
        f"change the swap files. Use a folder only you can change (e.g. a folder of your own inside it: mkdir "
        f"{os.path.join(base, 'mine')} and pass that), or pass SwapConfig(trust_folder_owner=True) (as config=; "
        f"StorageCache takes it as swap=) if you trust every user who can change it"
    )


def adopt_run_folder(folder: str, trust_owner: bool = False) -> None:
    """Check that the new run folder ``folder`` is this user's private folder (no link), and record its identity.

    Args:
        folder: The folder just made (by ``tempfile.mkdtemp``: ``0700``).
        trust_owner: Skip the owner and mode check (a folder the user trusts, e.g. on a filesystem without
            permissions such as vfat); it must still be a folder, not a link.

    Raises:
        PermissionError: When the name leads to a link, another user's folder or a folder others may open.
    """
    try:
        fd = os.open(folder, _FOLDER_FLAGS)
    except OSError as e:
        raise PermissionError(
            errno.EACCES,
            _replaced(folder, f"it cannot be opened as a folder without following links ({e.strerror})"),
            folder,
        ) from e
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    private = st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o077 if hasattr(os, "geteuid") else True
    if not private and not trust_owner:
        raise PermissionError(
            errno.EACCES,
            _replaced(folder, f"it is owned by {_user(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}"),
            folder,
        )
    with _lock:
        _identities[folder] = (st.st_dev, st.st_ino)


def check_run_folder(folder: str) -> None:
    """Refuse to go on when ``folder`` no longer is the run folder made (replaced by a link or another folder).

    Args:
        folder: A run folder recorded by ``adopt_run_folder`` (others are not checked).

    Raises:
        PermissionError: When the name now leads elsewhere (or nowhere).
    """
    with _lock:
        identity = _identities.get(folder)
    if identity is None:
        return
    try:
        st = os.lstat(folder)
    except OSError as e:
        raise PermissionError(errno.EACCES, _replaced(folder, f"it is gone ({e.strerror})"), folder) from e
    if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != identity:
        raise PermissionError(errno.EACCES, _replaced(folder, "another folder or a link now has its name"), folder)


def forget_run_folder(folder: str) -> None:
    """Stop checking ``folder`` (it is being removed)."""
    with _lock:
        _identities.pop(folder, None)


def _replaced(folder: str, why: str) -> str:
    return (
        f"the swap run folder {folder} is not the folder this run made: {why}. Someone who can change its base "
        f"folder replaced it; nothing more is written or read there (use a base folder only you can change)"
    )


def create_swap_file(path: str) -> None:
    """Create ``path`` readable and writable by its owner only (``0600``) if missing; a link there is refused.

    Args:
        path: The swap file.

    Raises:
        OSError: ``ELOOP`` when ``path`` is a link; any other error of creating it.
    """
    os.close(os.open(path, _FILE_FLAGS, 0o600))
