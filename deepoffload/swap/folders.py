"""Per-run, rank-aware swap folders, removed on close and at interpreter exit unless kept.

A run folder is ``<base>/deepoffload-rank<R>-<pid>.<start time>-<unique>``: two jobs (or two ranks of one job) on the
same base path never share files, and the rank in the name tells them apart when kept for inspection. The owner's
process id and start time in the name let the next run in the same base remove the folders of processes that died
without cleaning up (killed, out of memory); a live process's folder, and one kept on purpose, is never touched.
Names and the cleaning of dead runs' folders are ``dead_runs.py``'s.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import tempfile
import threading
import warnings
from typing import cast

from ..io.owners import create_private
from ..io.tree import remove_tree
from ..op_builder import env
from .dead_runs import KEPT, RUN_MARKER, remove_dead_run_folders, run_folder_prefix
from .folder_checks import adopt_run_folder, check_base, check_run_folder, forget_run_folder

# where each entry point takes its swap folder (only offload_parameters and its kin take path=)
CHOOSE_FOLDER = (
    "choose a writable folder: path= of offload_parameters, from_pretrained, offload_activations or StorageCache; "
    "SwapConfig(folder=...) for OffloadedOptimizer or TensorSwapper; --path on the command line"
)

_owned_lock = threading.Lock()
_owned: dict[str, int] = {}  # folder -> id of the process that created it (a forked child removes none of them)


def current_rank() -> int:
    """This process's rank.

    Returns:
        The rank in the default ``torch.distributed`` process group when one is initialised, else ``$RANK`` (set by
        torchrun), else 0.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return cast(int, env.get("RANK"))  # an "int" variable (default 0): parsed to an int or EnvError


def create_run_folder(base: str | None, rank: int | None = None, trust_owner: bool = False) -> str:
    """Create and return a fresh folder for this run's swap files under ``base``.

    Refuses a base folder another user could change (``folder_checks.check_base``) unless ``trust_owner``. Then
    removes the run folders there of processes no longer alive. Warns when ``base`` is on a filesystem that keeps
    files in memory (tmpfs). The new folder is checked to be this user's private folder and its identity recorded
    (``folder_checks.check_run_folder`` detects a replacement). It is registered for removal at interpreter exit;
    ``remove_run_folder`` removes it earlier, and ``keep_run_folder`` keeps it.

    Args:
        base: The base folder (None: the temp folder); created if missing, but its parent must exist.
        rank: The rank in the folder's name (None: ``current_rank()``).
        trust_owner: Accept a base folder that another user owns or may change.

    Returns:
        The new folder's path.

    Raises:
        PermissionError: When another user could change ``base`` (and ``trust_owner`` is false), naming the owner,
            the mode and what to do; or when the new folder is not this user's private folder.
        OSError: When the folder cannot be created (errno and base folder in the message; ``_make_base``'s
            ``FileNotFoundError`` for a missing parent and ``NotADirectoryError`` for a base that is a file come
            through as they are).
    """
    base = base or tempfile.gettempdir()
    _make_base(base)
    check_base(base, trust_owner)
    kind = memory_backed(base)
    if kind is not None:
        warnings.warn(
            f"swap folder {base} is on {kind}, which keeps files in memory: offloading there saves no "
            f"memory; pass a folder on a disk (SwapConfig(folder=...) or path=)",
            UserWarning,
            stacklevel=3,
        )
    try:
        remove_dead_run_folders(base)
        folder = tempfile.mkdtemp(prefix=run_folder_prefix(current_rank() if rank is None else rank), dir=base)
        os.close(create_private(os.path.join(folder, RUN_MARKER)))  # what dead-run cleaning looks for
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot create a swap folder in {base} ({e.strerror}); {CHOOSE_FOLDER}",
            base,
        ) from e
    adopt_run_folder(folder, trust_owner)
    with _owned_lock:
        _owned[folder] = os.getpid()
    return folder


def _make_base(base: str) -> None:
    """Create ``base`` if missing, but not its parents.

    A mistyped path (``/nvme0/...`` for ``/nvme/...``) must not quietly put swap files on another disk.

    Raises:
        NotADirectoryError: When ``base`` exists and is not a folder.
        FileNotFoundError: When the parent of ``base`` does not exist.
        OSError: When ``base`` cannot be created otherwise (errno and path in the message).
    """
    if os.path.isdir(base):
        return
    try:
        os.mkdir(base)
    except FileExistsError:
        if not os.path.isdir(base):
            raise NotADirectoryError(errno.ENOTDIR, f"swap folder {base} exists and is not a folder", base) from None
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"cannot create a swap folder at {base}: its parent "
            f"{os.path.dirname(os.path.abspath(base))} does not exist (only the last part of "
            f"the path is created; check the path, or create the parent first)",
            base,
        ) from None
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot create a swap folder at {base} ({e.strerror}); {CHOOSE_FOLDER}",
            base,
        ) from e


def memory_backed(folder: str) -> str | None:
    """The filesystem type when ``folder`` lies on one that keeps files in memory.

    Args:
        folder: The folder to look up.

    Returns:
        ``tmpfs`` or ``ramfs``, else None (also where mounts cannot be read: ``/proc/self/mountinfo`` is Linux's).
    """
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            mounts = f.read().splitlines()
    except OSError:  # not Linux: mounts cannot be read, so no warning (documented)
        return None
    path, best, kind = os.path.realpath(folder), -1, None
    for line in mounts:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), line.split(" - ", 1)[1].split()[0]
    return kind if kind in MEMORY_FILESYSTEMS else None


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def keep_run_folder(folder: str) -> None:
    """Leave ``folder`` in place at interpreter exit, and to later runs (it gets a ``KEPT`` file)."""
    _forget(folder)
    with open(os.path.join(folder, KEPT), "w", encoding="utf-8") as f:
        f.write("kept on purpose: later runs leave this folder alone\n")


def remove_run_folder(folder: str) -> None:
    """Remove ``folder`` and its files now (best effort; links in it are removed, never followed).

    A folder whose name now leads to another folder or a link (replaced by someone else) is left alone, with a
    warning.
    """
    _forget(folder)
    if not os.path.lexists(folder):  # removed already: nothing to do, nothing to warn about
        forget_run_folder(folder)
        return
    try:
        check_run_folder(folder)
    except PermissionError as e:
        warnings.warn(f"{e.strerror}; it is left in place", UserWarning, stacklevel=2)
        return
    finally:
        forget_run_folder(folder)
    with contextlib.suppress(OSError):
        remove_tree(folder, last=RUN_MARKER)  # the marker last: a removal killed midway is still cleaned next run


def _forget(folder: str) -> None:
    with _owned_lock:
        _owned.pop(folder, None)


def remove_run_folder_if_owned(folder: str) -> None:
    """Remove ``folder`` if this process made it and it is not kept (for finalizers: never a parent's folder)."""
    with _owned_lock:
        owned = _owned.get(folder) == os.getpid()
    if owned:
        remove_run_folder(folder)


@atexit.register
def _remove_owned() -> None:
    """Remove this process's folders at interpreter exit.

    A child forked after they were made (e.g. one exiting through ``sys.exit``) leaves them to its parent, which
    still uses them.
    """
    pid = os.getpid()
    with _owned_lock:
        folders = [folder for folder, owner in _owned.items() if owner == pid]
    for folder in folders:
        remove_run_folder(folder)
