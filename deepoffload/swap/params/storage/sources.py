"""Where a block's bytes live: its ``ByteSource``, asked instead of special-casing each kind of storage.

``SwapFiles``: the run's swap files, written at offload and after every change or step (the default).
``CheckpointFiles``: the tensors in place in a safetensors checkpoint (``serve_from_checkpoint=True``), read-only: a
block served from there is never written, so whatever would write it (training it, ``load_state_dict``, a dtype move,
releasing a change made in place, unpinning after a step) is refused or dropped, with the reason ``read_only`` gives.
A codec or a set of drives would be another source.
"""

from __future__ import annotations

from typing import Protocol


class ByteSource(Protocol):
    """Where one block's stored values are read from and whether they can be written there."""

    @property
    def writable(self) -> bool:
        """Whether the block's values can be written back (after a step, a change, a load, a dtype move)."""
        ...

    @property
    def where(self) -> str:
        """The file or folder the bytes are read from, as a message names it."""
        ...

    def read_only(self) -> str | None:
        """Why the bytes cannot be written, as a phrase ("served read-only from ..."); None when they can."""
        ...


class SwapFiles:
    """The block's own swap files: written at offload, read and written back as it streams."""

    writable = True
    where = "the swap folder"

    def read_only(self) -> None:
        """Never: swap files take every write."""
        return None


class CheckpointFiles:
    """The block's tensors in place in a checkpoint file, read-only (``serve_from_checkpoint=True``).

    Args:
        path: The checkpoint file holding the block's tensors.
    """

    writable = False

    def __init__(self, path: str):
        self.where = path

    def read_only(self) -> str:
        """The phrase every refusal of a write uses."""
        return f"served read-only from the checkpoint {self.where} (serve_from_checkpoint=True)"
