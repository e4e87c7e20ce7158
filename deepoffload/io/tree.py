"""Removing a folder tree that someone else may have shaped: no recursion, no link followed, no swapped folder entered.

``shutil.rmtree`` recurses once per level (a tree 1,500 folders deep raises ``RecursionError``) and keeps one
descriptor open per level. ``remove_tree`` walks with two descriptors at most: it goes down with
``openat(O_NOFOLLOW | O_DIRECTORY)`` (a link is removed as a link, never entered) and back up through ``..``, checking
that ``..`` is the folder it came from (device and inode), so a folder moved away while the walk is inside it stops the
walk instead of removing files elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# read once, at import: whether the system's open and unlink take dir_fd (not on Windows), asked of the functions
# themselves (a wrapper put on os.unlink later, as a test may, is not in os.supports_dir_fd but still takes dir_fd)
_DIR_FD = os.open in os.supports_dir_fd and os.unlink in os.supports_dir_fd


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def remove_tree(path: str | os.PathLike[str], owner: int | None = None, last: str | None = None) -> None:
    """Remove the folder ``path`` and everything in it, without following links or recursing.

    A link anywhere in the tree (``path`` itself included) is removed as a link; what it points to is never touched.
    Where the system has no ``dir_fd`` support (Windows), ``shutil.rmtree`` does the work.

    Args:
        path: The folder to remove (a link there is refused, not followed).
        owner: When given, the user id that must own ``path``; another owner's folder is refused.
        last: A name directly in ``path`` removed after everything else (a marker that says what the folder is:
            a removal killed midway leaves it, so the next cleaning still knows the folder).

    Raises:
        PermissionError: When ``owner`` is given and does not own ``path``.
        OSError: When a part cannot be removed (the error of that part); ``NotADirectoryError`` (or ``ELOOP``) when
            ``path`` is a link or not a folder; ``ESTALE`` when a folder is moved away during the walk. What was
            removed before stays removed.
    """
    path = os.path.abspath(os.fspath(path))
    if not _DIR_FD:  # pragma: no cover (Windows)
        import shutil

        for entry in os.scandir(path):
            if entry.name == last:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        shutil.rmtree(path)
        return
    parent_fd = os.open(os.path.dirname(path), _FLAGS)
    try:
        name = os.path.basename(path)
        top = os.open(name, _FLAGS | _NOFOLLOW, dir_fd=parent_fd)
        try:
            st = os.fstat(top)
            if owner is not None and st.st_uid != owner:
                raise PermissionError(f"{path} is owned by user {st.st_uid}, not {owner}: not removed")
        except BaseException:
            os.close(top)
            raise
        _empty(top, path, keep=last)  # closes top
        if last is not None:
            top = os.open(name, _FLAGS | _NOFOLLOW, dir_fd=parent_fd)
            try:
                if _identity(os.fstat(top)) != _identity(st):
                    raise OSError(errno.ESTALE, f"{path} was replaced while it was being removed; stopped there")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(last, dir_fd=top)
            finally:
                os.close(top)
        os.rmdir(name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)


def _empty(fd: int, path: str, keep: str | None = None) -> None:
    """Remove everything inside the folder open as ``fd`` (closed on return) but ``keep``, depth first."""  # noqa: DOC501
    above: list[tuple[str, tuple[int, int]]] = []  # (name of the folder entered, identity of the one it is in)
    current = fd
    try:
        while True:
            sub = _clear_files(current, keep if not above else None)
            if sub is not None:
                try:
                    child = os.open(sub, _FLAGS | _NOFOLLOW, dir_fd=current)
                except FileNotFoundError:
                    continue  # removed meanwhile: list again
                above.append((sub, _identity(os.fstat(current))))
                os.close(current)
                current = child
                continue
            if not above:
                return
            name, identity = above.pop()
            up = os.open("..", _FLAGS, dir_fd=current)
            if _identity(os.fstat(up)) != identity:
                os.close(up)
                message = f"a folder under {path} was moved while it was being removed; stopped there"
                raise OSError(errno.ESTALE, message)
            os.close(current)
            current = up
            os.rmdir(name, dir_fd=current)
    finally:
        os.close(current)


def _clear_files(fd: int, keep: str | None = None) -> str | None:
    """Unlink every entry of the folder ``fd`` but folders and ``keep`` (links included); a sub-folder's name."""  # noqa: DOC201
    with os.scandir(fd) as listing:
        for entry in listing:
            if entry.name == keep:
                continue
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                return entry.name
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:  # removed meanwhile: the goal is reached
                pass
    return None
