"""``ActivationDrives``: saved activations spread over one ``ActivationStore`` per drive.

``offload_activations(path=[a, b, ...])`` (or ``SwapConfig(folder=[...])``) gives each drive a store of its own: its
run folder and file, its own async-IO handle (a queue per drive: a slow drive never holds back the others'
submissions) and its share of the bytes being written at once (``buffer_count * chunk_bytes`` in all, split evenly,
at least one tensor each). Folders on one device are one drive (``swap.layouts.multi_folder.distinct_drives``: the
first is used, the others dropped with a warning); every folder must exist. Each saved tensor goes to the drive with
the fewest bytes placed per unit of weight (``SwapConfig.folder_speeds``, equal without), so the forward writes and
the backward reads every drive at once. Each store's run folder is made by ``create_run_folder``, which also removes
the folders that dead runs left under that base folder: a crashed run's files go from every drive.
"""

from __future__ import annotations

import torch

from ..swap.config import SwapConfig
from ..swap.layouts.multi_folder import distinct_drives
from .store import ActivationStore, StoredBytes


class ActivationDrives:
    """The stores of one run, one per drive; the same calls as one ``ActivationStore``, routed per record.

    Not thread-safe by itself: ``ActivationOffload`` calls it under its lock.

    Args:
        config: One folder, or several (each on its own device), with the settings of ``ActivationStore``.

    Raises:
        FileNotFoundError: When one of several folders does not exist (naming it).
        ValueError: When ``config.folder_speeds`` does not fit the folders.
    """

    def __init__(self, config: SwapConfig):
        if isinstance(config.folder, tuple):
            speeds = None if config.folder_speeds is None else list(config.folder_speeds)
            kept, weights = distinct_drives(list(config.folder), speeds)
            folders: list[str | None] = list(kept)
        else:
            folders, weights = [config.folder], [1.0]  # (None: the temp folder)
        share = max(1, config.buffer_count // len(folders))  # the bound on bytes being written stays the run's
        self.weights = weights
        self.placed = [0] * len(folders)  # bytes placed on each drive
        self.reported = False  # a failed write was reported (once for the run, whichever drive it was)
        self.stores: list[ActivationStore] = []
        try:
            for folder in folders:
                self.stores.append(
                    ActivationStore(config.replace(folder=folder, folder_speeds=None, buffer_count=share))
                )
        except BaseException:
            self.close()
            raise

    # -- placement --------------------------------------------------------------------------------------------
    def write(self, original: torch.Tensor, version: int, index: int, copy: bool = False) -> StoredBytes:
        """``ActivationStore.write`` on the drive with the fewest bytes placed per unit of weight.

        Args:
            original: The saved tensor, detached (in CPU memory).
            version: The saved tensor's version counter at the save.
            index: The position in the forward's order.
            copy: Write (and keep) a copy made now (see ``ActivationStore.write``).

        Returns:
            The record (``drive`` says which store holds it).
        """
        drive = min(range(len(self.stores)), key=lambda i: self.placed[i] / self.weights[i])
        stored = self.stores[drive].write(original, version, index, copy)
        stored.drive = drive
        self.placed[drive] += stored.nbytes
        return stored

    def _of(self, stored: StoredBytes) -> ActivationStore:
        return self.stores[stored.drive]

    # -- the calls of one store -----------------------------------------------------------------------------------
    def start_read(self, stored: StoredBytes) -> None:
        """``ActivationStore.start_read`` on the record's drive."""
        self._of(stored).start_read(stored)

    def bytes_of(self, stored: StoredBytes) -> tuple[torch.UntypedStorage, int]:
        """``ActivationStore.bytes_of`` on the record's drive.

        Args:
            stored: The record.

        Returns:
            The storage and the byte offset of the record's bytes in it.
        """
        return self._of(stored).bytes_of(stored)

    def free(self, stored: StoredBytes) -> None:
        """``ActivationStore.free`` on the record's drive."""
        self._of(stored).free(stored)

    def reap(self, wait: bool = False) -> None:
        """Collect the completed writes of every drive (``wait``: all of them)."""
        for store in self.stores:
            store.reap(wait)

    def take_error(self) -> OSError | None:
        """The first failed write of any drive not yet reported, once.

        Returns:
            The ``OSError`` (errno, the drive's file and offset in it), or None.
        """
        if self.reported:
            return None
        for store in self.stores:
            error = store.take_error()
            if error is not None:
                self.reported = True
                return error
        return None

    def close(self) -> None:
        """Close every drive's store (each waits for its writes and removes its run folder); idempotent."""
        errors = []
        for store in self.stores:
            try:
                store.close()
            except BaseException as e:  # (the other drives are still closed)
                errors.append(e)
        if errors:
            raise errors[0]

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def failed(self) -> OSError | None:
        """The first failed write of any drive (until reported), or None."""
        return next((s.failed for s in self.stores if s.failed is not None), None)

    @property
    def live(self) -> int:
        """Stored tensors not yet freed, on every drive."""
        return sum(s.live for s in self.stores)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return all(s.closed for s in self.stores)

    @property
    def folders(self) -> list[str]:
        """The run folder on each drive."""
        return [s.folder for s in self.stores]

    @property
    def bytes_written(self) -> int:
        """Bytes written, on every drive."""
        return sum(s.bytes_written for s in self.stores)

    @property
    def bytes_read(self) -> int:
        """Bytes read back, on every drive."""
        return sum(s.bytes_read for s in self.stores)

    @property
    def file_bytes(self) -> int:
        """Bytes of the files in use, on every drive."""
        return sum(s.file_bytes for s in self.stores)

    @property
    def peak_held(self) -> int:
        """The most bytes the run held at once: tensors being written and reads not yet handed out.

        With several drives, the sum of each drive's most (an upper bound).
        """
        return sum(s.peak_held for s in self.stores)
