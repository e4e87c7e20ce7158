"""``StorageLayout``: where a ``TensorSwapper``'s records live on storage, and the life of this run's files there.

A layout owns this run's place on storage (one run folder, or one on each of several drives): it makes
it at construction (removing what dead runs left there), names the file of each group (and the one pack file of a
packed swapper), creates swap files readable by their owner only, checks before each transfer that its place is
still the one it made, and removes everything at ``close`` unless kept. The swapper asks it for nothing else: the
bytes' placement inside a file (offsets, extents) stays the swapper's.

To add a layout: subclass ``StorageLayout`` in a file of its own and register it by name
(``deepoffload.swap.layouts.register_layout``); ``SwapConfig(layout=name)`` then selects it.
"""

from __future__ import annotations

import abc
import os
from typing import ClassVar, Protocol

from ..folder_checks import create_swap_file


class LayoutSettings(Protocol):
    """The settings a layout reads (``SwapConfig`` has them; the config module imports the registry to check names)."""

    @property
    def folder(self) -> str | tuple[str, ...] | None:
        """The base folder (None: the temp folder), or several (a tuple: one per drive)."""
        ...

    @property
    def keep_files(self) -> bool:
        """Leave the files at close."""
        ...

    @property
    def trust_folder_owner(self) -> bool:
        """Accept a base folder another user owns."""
        ...


class StorageLayout(abc.ABC):
    """Where a swapper's records live: made for one swapper, from its config, and closed with it.

    Args:
        config: The swapper's settings (``folder``, ``keep_files``, ``trust_folder_owner`` concern the layout).
        rank: The process's rank (None: taken from the environment), for names that tell ranks apart.

    Attributes:
        name: The name it is registered under (set by ``register_layout``).
        description: One line for ``deepoffload report``'s table of extensions.
        folder: This run's folder (the first one, for a layout with several), shown in reprs and messages.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    folder: str

    @abc.abstractmethod
    def __init__(self, config: LayoutSettings, rank: int | None = None) -> None: ...

    @abc.abstractmethod
    def group_file(self, group: str) -> str:
        """The file that holds ``group``'s records in an unpacked swapper; its folder exists once this returns.

        Args:
            group: The group's name (letters, digits, ``-``, ``_``, ``.``; not starting with ``.``).

        Returns:
            The file's path (the same for the same group until ``close``).
        """

    @abc.abstractmethod
    def pack_file(self) -> str:
        """The one file of a packed swapper; its folder exists once this returns.

        Returns:
            The file's path.
        """

    def pack_files(self) -> list[str]:
        """The files of a packed swapper: ``[pack_file()]``; a layout over several drives returns one per drive.

        Each new extent goes to the file holding the fewest allocated bytes (``PackedLayout``).

        Returns:
            The files' paths (at least one).
        """
        return [self.pack_file()]

    def pack_weights(self) -> list[float]:
        """Each pack file's share of new extents (``PackedLayout`` puts one where allocated bytes / weight is least).

        Returns:
            One positive weight per ``pack_files()`` entry (equal by default).
        """
        return [1.0] * len(self.pack_files())

    @property
    def drives(self) -> int:
        """How many drives this layout's files lie on; the swapper opens one IO handle (one queue) per drive."""
        return 1

    def drive(self, path: str) -> int:
        """The drive holding ``path`` (an index below ``drives``), whose IO handle moves its bytes.

        Args:
            path: A path this layout named.

        Returns:
            0 here (one drive).
        """
        return 0

    @abc.abstractmethod
    def check(self) -> None:
        """Refuse to go on when this run's place is no longer the one made (called before every transfer).

        Raises:
            PermissionError: When a folder was replaced (by a link or another folder) or removed.
        """

    @abc.abstractmethod
    def keep(self) -> None:
        """Leave this run's files in place at ``close``, at exit and to later runs' cleaning."""

    @abc.abstractmethod
    def close(self) -> None:
        """Remove this run's files and folders (unless kept); best effort, never raises for a missing one."""

    def create_file(self, path: str) -> None:
        """Create the swap file ``path`` ``0600`` if missing, refusing a link there (before the IO op opens it).

        Args:
            path: A path this layout named (``group_file`` or ``pack_file``).
        """
        create_swap_file(path)

    def remove_file(self, path: str) -> None:
        """Remove the swap file ``path`` (a discarded group's); a missing one is fine.

        Args:
            path: A path this layout named.
        """
        try:
            os.unlink(path)
        except FileNotFoundError:  # never written, or removed already: the goal is reached
            pass
