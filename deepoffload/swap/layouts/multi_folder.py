"""The ``drives`` storage layout: a run folder on each of several drives, records spread over all of them.

``SwapConfig(folder=[a, b, ...])`` selects it. Each folder gets a run folder of its own (``deepoffload.swap.folders``:
dead runs' folders there removed when it is made, its identity checked before every transfer, removed at ``close``
and at exit unless kept). Groups go to the drives by smooth weighted round robin: drive ``i`` gets a share of the
groups proportional to ``weights[i]`` (``SwapConfig.folder_speeds``, what ``deepoffload tune --folder A --folder B``
measured; equal shares without), so a model's blocks, written and read in order, keep every drive busy at once. A
packed swapper (``OffloadedOptimizer``'s) has one pack file per drive; each new extent goes to the one whose
allocated bytes per unit of weight are fewest. Each drive has its own IO handle (``drive(path)`` tells the swapper
which): a slow drive's queue never holds back the others' submissions.

Folders on one device (the same ``st_dev``) are one drive: the first is used, the others dropped with a warning
(they would add a queue, not bandwidth). Every folder must exist: a missing one is a mount point not mounted, and
making it would put that drive's share on whatever disk holds its parent.
"""

from __future__ import annotations

import errno
import os
import tempfile
import warnings
import weakref
from collections.abc import Sequence

from ..folder_checks import check_run_folder
from ..folders import create_run_folder, keep_run_folder, remove_run_folder, remove_run_folder_if_owned
from .base import LayoutSettings, StorageLayout
from .registry import register_layout


def distinct_drives(folders: Sequence[str], weights: Sequence[float] | None = None) -> tuple[list[str], list[float]]:
    """The folders that lie on distinct devices, with their weights; a folder on a device already listed is dropped.

    Args:
        folders: The base folders, each existing.
        weights: Each folder's measured speed (any positive unit; None: all equal).

    Returns:
        The folders kept (first of each device, in the given order) and their weights.

    Raises:
        FileNotFoundError: When a folder does not exist (naming it).
        NotADirectoryError: When a path is not a folder (naming it).
        ValueError: When ``weights`` has another length than ``folders`` or a weight is not a positive number.
    """
    if weights is not None and len(weights) != len(folders):
        raise ValueError(f"folder_speeds: {len(weights)} speeds for {len(folders)} folders; give one per folder")
    weights = [1.0] * len(folders) if weights is None else [float(w) for w in weights]
    if any(not w > 0 for w in weights):
        raise ValueError(f"folder_speeds: every speed must be a positive number, got {list(weights)}")
    seen: dict[int, str] = {}
    kept: list[str] = []
    kept_weights: list[float] = []
    for folder, weight in zip(folders, weights):
        if not os.path.exists(folder):
            raise FileNotFoundError(
                errno.ENOENT,
                f"swap folder {folder} does not exist: with several folders each must exist already (a missing one "
                f"is often a drive not mounted; its share would land on the disk holding its parent)",
                folder,
            )
        if not os.path.isdir(folder):
            raise NotADirectoryError(errno.ENOTDIR, f"swap folder {folder} is not a folder", folder)
        device = os.stat(folder).st_dev
        if device in seen:
            warnings.warn(
                f"swap folders {seen[device]} and {folder} are on the same device ({os.major(device)}:"
                f"{os.minor(device)}): counted once, {folder} is not used (it would add a queue, not bandwidth)",
                UserWarning,
                stacklevel=4,
            )
            continue
        seen[device] = folder
        kept.append(folder)
        kept_weights.append(weight)
    return kept, kept_weights


def _next(credit: list[float], weights: Sequence[float]) -> int:
    """One step of smooth weighted round robin: every drive earns its weight, the richest pays the total and is next."""
    for i, weight in enumerate(weights):
        credit[i] += weight
    best = max(range(len(credit)), key=credit.__getitem__)
    credit[best] -= sum(weights)
    return best


def placement(weights: Sequence[float], count: int) -> list[int]:
    """The drives of the first ``count`` groups a fresh ``drives`` layout places (what ``deepoffload plan`` shows).

    Args:
        weights: Each drive's share (``MultiFolder.weights``).
        count: How many groups.

    Returns:
        The drive index of each group, in the order the groups are first written.
    """
    credit = [0.0] * len(weights)
    return [_next(credit, weights) for _ in range(count)]


@register_layout("drives")
class MultiFolder(StorageLayout):
    """A run folder under each of ``config.folder``'s folders, one per drive, with records spread over them.

    Args:
        config: Where (``folder``: a tuple of folders; ``folder_speeds``: their measured speeds, or None), and
            whether the files are kept (``keep_files``) or the base folders' owners trusted (``trust_folder_owner``).
        rank: The rank in the run folders' names (None: taken from the environment).

    Raises:
        FileNotFoundError: When a folder does not exist (naming it).
        ValueError: When ``folder_speeds`` does not give one positive speed per folder.

    Attributes:
        folders: This run's folders, one per drive (``folder`` is the first).
        weights: Each drive's share of the records (the measured speeds, or 1.0 each).
    """

    description = "a run folder on each of several drives (folder=[...]), records spread by each drive's speed"

    def __init__(self, config: LayoutSettings, rank: int | None = None) -> None:
        bases = list(config.folder) if isinstance(config.folder, tuple) else [config.folder or tempfile.gettempdir()]
        speeds = getattr(config, "folder_speeds", None)
        bases, self.weights = distinct_drives(bases, speeds)
        self.folders: list[str] = []
        try:
            for base in bases:
                self.folders.append(create_run_folder(base, rank, config.trust_folder_owner))
        except BaseException:
            for folder in self.folders:  # (nothing of a half-made layout stays behind)
                remove_run_folder(folder)
            raise
        self.folder = self.folders[0]
        for folder in self.folders:
            if config.keep_files:
                keep_run_folder(folder)
            weakref.finalize(self, remove_run_folder_if_owned, folder).atexit = False
        self._kept = config.keep_files
        self._credit = [0.0] * len(self.folders)  # smooth weighted round robin's running credits
        self._files: dict[str, str] = {}  # group -> its file (stays until close)

    @property
    def drives(self) -> int:
        """The number of drives (distinct devices) used."""
        return len(self.folders)

    def drive(self, path: str) -> int:
        """The drive holding ``path``, a file this layout named.

        Args:
            path: The file's path.

        Returns:
            The drive's index into ``folders``.
        """
        parent = os.path.dirname(path)
        return self.folders.index(parent) if parent in self.folders else 0

    def next_drive(self) -> int:
        """The drive the next new group goes to (smooth weighted round robin: shares follow ``weights``).

        Returns:
            The drive's index.
        """
        return _next(self._credit, self.weights)

    def group_file(self, group: str) -> str:
        """``<run folder of the group's drive>/<group>.swp``; a new group's drive is ``next_drive()``.

        Args:
            group: The group's name.

        Returns:
            The file's path (the same for the same group until ``close``).
        """
        file = self._files.get(group)
        if file is None:
            file = self._files[group] = os.path.join(self.folders[self.next_drive()], f"{group}.swp")
        return file

    def pack_file(self) -> str:
        """``<first run folder>/pack.swp``.

        Returns:
            The file's path.
        """
        return os.path.join(self.folder, "pack.swp")

    def pack_files(self) -> list[str]:
        """``<run folder>/pack.swp`` on every drive.

        Returns:
            The files' paths, in drive order.
        """
        return [os.path.join(folder, "pack.swp") for folder in self.folders]

    def pack_weights(self) -> list[float]:
        """Each pack file's share (``weights``).

        Returns:
            The weights, in ``pack_files`` order.
        """
        return list(self.weights)

    def check(self) -> None:
        """Refuse to go on when any run folder was replaced (``folder_checks.check_run_folder``)."""
        for folder in self.folders:
            check_run_folder(folder)

    def keep(self) -> None:
        """Keep every run folder (a ``KEPT`` file in each: later runs leave them alone)."""
        if not self._kept:
            for folder in self.folders:
                keep_run_folder(folder)
            self._kept = True

    def close(self) -> None:
        """Remove every run folder (unless kept)."""
        if not self._kept:
            for folder in self.folders:
                remove_run_folder(folder)
