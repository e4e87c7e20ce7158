"""Putting safetensors shards in place: whenever the writer dies, readers see the old set or the new one, never a mix.

Every file of a save is written and fsynced under a temporary name first (created ``0600``; see
``deepoffload.io.owners``). Then:

- one shard: it is renamed to ``<prefix>.safetensors`` (the one atomic step), the folder fsynced, and only then are
  an older index and its shards removed;
- several shards: they are renamed to names no earlier save used, ``<prefix>-00001-of-0000N-<generation>.safetensors``
  (``generation``: 8 random hex digits, also recorded in the index's ``metadata``), the folder fsynced, and the index
  ``<prefix>.safetensors.index.json`` renamed over the old one: that rename switches every reader that follows the
  index (this package, ``safetensors`` driven by the index, ``transformers``) from the complete old set to the
  complete new one. Then the folder is fsynced and the files of earlier saves are removed.

Killed before the switch, the folder still holds the old checkpoint (plus unused files, removed by the next save
there); killed after it, the new one.

Saves that overlap in one folder: the shards' final renames, the switch and the removal of earlier files run under
the folder's save lock (``deepoffload.io.folder_lock``), and a save in progress has only temporaries that name their
live writer (never removed). So each removal runs right after its own save's switch with no other switch possible,
and removes only shards that the index it just put in place does not name: files of earlier saves, or of saves that
died. The save whose switch comes last is what the folder holds once both end, and at every moment it holds the
complete set its last switch named. A folder holding both an index and ``<prefix>.safetensors`` (killed while
switching between the two layouts) has each complete: this package reads the set the index names, ``transformers``
the single file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from pathlib import Path

from ..io.folder_lock import folder_lock
from ..io.owners import adopt_mode, create_private, remove_dead_temporaries, temporary_name

INDEX_SUFFIX = ".safetensors.index.json"


def new_generation() -> str:
    """8 random hex digits naming one save's shards."""
    return uuid.uuid4().hex[:8]


def shard_names(prefix: str, count: int, generation: str) -> list[str]:
    """The final file names of a save's ``count`` shards."""
    if count == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i:05d}-of-{count:05d}-{generation}.safetensors" for i in range(1, count + 1)]


def sync_folder(folder: Path) -> None:
    """fsync ``folder`` so the renames in it are durable (a no-op where folders cannot be opened: Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # no folder descriptors here (Windows): the renames are as durable as this system makes them
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index(path: Path, weight_map: dict[str, str], total_bytes: int, generation: str) -> None:
    """Write and fsync the index document to the new temporary file ``path`` (created ``0600``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump(
            {"metadata": {"total_size": total_bytes, "generation": generation}, "weight_map": weight_map},
            f,
            indent=2,
            ensure_ascii=False,
        )
        f.flush()
        os.fsync(f.fileno())


def commit(
    folder: Path, prefix: str, temporaries: list[Path], index_temporary: Path | None, generation: str
) -> list[Path]:
    """Switch ``folder`` to a save's synced shards as the module docstring says.

    Args:
        folder: The checkpoint's folder.
        prefix: The file names' start.
        temporaries: The save's synced shards, under their temporary names, in order.
        index_temporary: For several shards, the save's synced index under its temporary name; None for one.
        generation: The save's generation (in the shards' final names).

    Returns:
        The shards' final paths.

    Raises:
        TimeoutError: When another save into ``folder`` holds its lock for longer than ``folder_lock.TIMEOUT_S``.
    """
    names = shard_names(prefix, len(temporaries), generation)
    index = folder / f"{prefix}{INDEX_SUFFIX}"
    single = folder / f"{prefix}.safetensors"
    finals = [folder / name for name in names]
    with folder_lock(folder):  # no other save switches or removes files until this one's removal is done
        model = index if index.exists() else single  # the checkpoint being replaced lends its mode to the new files
        for temporary in temporaries + ([index_temporary] if index_temporary is not None else []):
            adopt_mode(temporary, model)
        for temporary, final in zip(temporaries, finals):
            os.replace(temporary, final)
        sync_folder(folder)  # the shards are in place before the index that names them can be
        if index_temporary is not None:
            os.replace(index_temporary, index)
            sync_folder(folder)
        else:
            with contextlib.suppress(FileNotFoundError):
                index.unlink()
        remove_stale(folder, prefix, set(names))
    return finals


def remove_stale(folder: Path, prefix: str, keep: set[str]) -> None:
    """Remove the shards of earlier saves with ``prefix`` from ``folder`` (all but the names in ``keep``).

    Only under the folder's lock, just after the switch to ``keep`` (see the module docstring).
    """
    stale = re.compile(rf"{re.escape(prefix)}(-\d{{5}}-of-\d{{5}}(-[0-9a-f]{{8}})?)?\.safetensors")
    for path in folder.iterdir():
        if stale.fullmatch(path.name) and path.name not in keep:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def install_files(source: Path, folder: Path) -> None:
    """Put every file of the folder ``source`` into ``folder`` under its name, each replacing the old one atomically.

    Each is copied to a private temporary in ``folder``, fsynced, given the mode of the file it replaces and renamed
    over it; then ``folder`` is fsynced. Killed at any point, each target holds its old bytes or its new ones (a
    Hugging Face ``config.save_pretrained`` writes ``config.json`` in place: killed there, it was left half written).
    Temporaries of the same names left by dead writers are removed first.

    Args:
        source: A folder of new files (sub-folders are ignored).
        folder: Where they go.
    """
    for entry in sorted(source.iterdir()):
        if not entry.is_file():
            continue
        target = folder / entry.name
        remove_dead_temporaries(folder, entry.name)
        temporary = folder / temporary_name(entry.name)
        try:
            with open(create_private(temporary), "wb") as f:
                f.write(entry.read_bytes())
                f.flush()
                os.fsync(f.fileno())
            adopt_mode(temporary, target)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
            raise
    sync_folder(folder)
