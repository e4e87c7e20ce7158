"""The ``folder`` storage layout: every file of a run in one private run folder under ``SwapConfig.folder``.

The run folder is ``deepoffload.swap.folders``'s (rank-aware name, dead runs' folders removed when it is made, its
identity checked before every transfer, removed at ``close`` and at exit unless kept, and when its swapper is dropped
without ``close``). A group's file is ``<run folder>/<group>.swp``; a packed swapper's is ``<run folder>/pack.swp``.
"""

from __future__ import annotations

import os
import weakref

from ...errors import ConfigError
from ..folder_checks import check_run_folder
from ..folders import create_run_folder, keep_run_folder, remove_run_folder, remove_run_folder_if_owned
from .base import LayoutSettings, StorageLayout
from .registry import register_layout


@register_layout("folder")
class OneFolder(StorageLayout):
    """One run folder under ``config.folder`` (None: the temp folder) holding every file of the run.

    Args:
        config: Where (``folder``), and whether the files are kept (``keep_files``) or the base folder's owner
            trusted (``trust_folder_owner``).
        rank: The rank in the run folder's name (None: taken from the environment).

    Raises:
        ConfigError: When ``config.folder`` is several folders.
    """

    description = "every file of a run in one private run folder under the swap folder"

    def __init__(self, config: LayoutSettings, rank: int | None = None) -> None:
        if isinstance(config.folder, tuple):  # (SwapConfig picks the drives layout for a list)
            raise ConfigError(f"layout 'folder' takes one folder, got {list(config.folder)}; use layout='drives'")
        self.folder = create_run_folder(config.folder, rank, config.trust_folder_owner)
        if config.keep_files:
            keep_run_folder(self.folder)
        # Dropped without close(): its files go with it, not at exit (a loop making optimizers would fill the disk).
        weakref.finalize(self, remove_run_folder_if_owned, self.folder).atexit = False
        self._kept = config.keep_files

    def group_file(self, group: str) -> str:
        """``<run folder>/<group>.swp``.

        Args:
            group: The group's name.

        Returns:
            The file's path.
        """
        return os.path.join(self.folder, f"{group}.swp")

    def pack_file(self) -> str:
        """``<run folder>/pack.swp``.

        Returns:
            The file's path.
        """
        return os.path.join(self.folder, "pack.swp")

    def check(self) -> None:
        """Refuse to go on when the run folder was replaced (``folder_checks.check_run_folder``)."""
        check_run_folder(self.folder)

    def keep(self) -> None:
        """Keep the run folder (a ``KEPT`` file in it: later runs leave it alone)."""
        if not self._kept:
            keep_run_folder(self.folder)
            self._kept = True

    def close(self) -> None:
        """Remove the run folder (unless kept)."""
        if not self._kept:
            remove_run_folder(self.folder)
