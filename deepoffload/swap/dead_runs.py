"""Per-run swap folders' names, and the cleaning of the folders of runs whose process died.

A run folder is ``<base>/deepoffload-rank<R>-<pid>.<start time>.<host id>-<unique>`` holding a ``RUN_MARKER`` file;
the owner's token (``deepoffload.io.owners.process_token``) lets the next run in the same base remove the folders of
processes that died without cleaning up, never a live one's, nor one kept on purpose (``KEPT``).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from ..io.owners import OWNER_PATTERN, owner_alive, process_token
from ..io.tree import remove_tree

KEPT = "KEPT"  # a file in a run folder that is to outlive its process
RUN_MARKER = ".deepoffload-run"  # a file in every run folder this library makes: what dead-run cleaning looks for
_RUN_FOLDER = re.compile(rf"deepoffload-rank\d+-{OWNER_PATTERN}-[a-z0-9_]+")  # mkdtemp's random part
_log = logging.getLogger("deepoffload")


def run_folder_prefix(rank: int) -> str:
    """The start of a per-run swap folder's name; ``tempfile.mkdtemp`` adds the random part.

    Args:
        rank: The rank in the name.

    Returns:
        ``deepoffload-rank<rank>-<process token>-``.
    """
    return f"deepoffload-rank{rank}-{process_token()}-"


def _remove_if_empty(path: str) -> bool:
    """Remove ``path`` if it is an empty folder; whether it was removed."""
    try:
        os.rmdir(path)
    except OSError:  # not empty (or gone, or not ours to remove): left as it is
        return False
    return True


def remove_dead_run_folders(base: str | os.PathLike[str]) -> list[Path]:
    """Remove the per-run swap folders in ``base`` of processes that are no longer alive.

    Only a folder (not a link) named as ``run_folder_prefix`` names it, owned by this process's user and holding the
    ``RUN_MARKER`` file is a candidate; one holding a ``KEPT`` file stays. Such a folder of a dead run without the
    marker is removed only when empty (a run killed between making it and writing the marker). Anything else in
    ``base`` may be another user's, planted on purpose: it is never entered. Removal walks the tree without
    recursion and without following links (``remove_tree``). Any error, listing ``base`` or removing one folder, is
    logged (logger ``deepoffload``) and passed over: leftovers never stop a set-up.

    Args:
        base: The folder holding the run folders.

    Returns:
        The folders removed.
    """
    removed: list[Path] = []
    try:
        with os.scandir(base) as listing:
            entries = [(entry, match) for entry in listing if (match := _RUN_FOLDER.fullmatch(entry.name))]
    except OSError as e:
        _log.warning("could not list %s to remove dead swap folders: %s", base, e)
        return removed
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for entry, match in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or (uid is not None and st.st_uid != uid):
                continue  # a link, a file, or another user's: not ours to judge
            if not os.path.lexists(os.path.join(entry.path, RUN_MARKER)):
                # not made by this library, or made by a run killed before it wrote the marker (then empty): rmdir
                # removes an empty folder only, so nothing anyone put there is lost
                if not owner_alive(match) and _remove_if_empty(entry.path):
                    removed.append(Path(entry.path))
                continue
            if os.path.lexists(os.path.join(entry.path, KEPT)) or owner_alive(match):
                continue
            remove_tree(entry.path, owner=uid, last=RUN_MARKER)
        except Exception as e:  # noqa: BLE001 - whatever someone else's leftover does, set-up goes on
            _log.warning("left the dead swap folder %s in place: %s: %s", entry.path, type(e).__name__, e)
            continue
        removed.append(Path(entry.path))
    return removed
