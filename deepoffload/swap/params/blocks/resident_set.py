"""``ResidentSet``: which blocks ``max_resident_bytes`` keeps in memory, chosen by how often each block is read.

Each block's runs are counted (``count``). The blocks kept are the most-run ones that fit the budget (stored plus
compute copy), ties in block order: before anything ran, and in a decoder-only model where every block runs once per
token, that is the first blocks first. Where blocks run unequally often, as in an encoder-decoder ``generate`` (the
encoder once, the decoder once per token), the set follows the counts: ``stale`` says when the most-run blocks that fit
differ from those kept, by at least ``MARGIN`` runs, so that blocks run about equally often are never swapped back and
forth. ``ParameterOffload`` without an optimizer asks it before an inference forward of a block and re-pins then
(``tests/swap/params/test_resident_set.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

MARGIN = 2  # runs by which a block left out must lead one kept before the set changes


class Sized(Protocol):
    """What the set needs of a block: its index and the bytes it holds when kept."""

    index: int
    nbytes: int
    compute_nbytes: int


B = TypeVar("B", bound=Sized)


class ResidentSet:
    """Counts block runs and chooses the most-run blocks that fit a budget (ties: the first blocks first).

    Args:
        blocks: How many blocks the model streams.
    """

    def __init__(self, blocks: int):
        self.runs = [0] * blocks

    def count(self, index: int) -> None:
        """Count one run of block ``index`` (its forward, or its backward's recompute).

        Args:
            index: The block's index.
        """
        self.runs[index] += 1

    def choose(self, blocks: Sequence[B], budget: int) -> list[B]:
        """The blocks to keep: the most-run first (ties in block order), each taken while it fits what is left.

        Args:
            blocks: The model's blocks, in block order.
            budget: Bytes for kept blocks (stored plus compute copy).

        Returns:
            The chosen blocks, in block order.
        """
        chosen = []
        for block in sorted(blocks, key=lambda b: (-self.runs[b.index], b.index)):
            need = block.nbytes + block.compute_nbytes
            if need <= budget:
                chosen.append(block)
                budget -= need
        return sorted(chosen, key=lambda b: b.index)

    def stale(self, blocks: Sequence[Sized], budget: int, kept: Iterable[int]) -> bool:
        """Whether the blocks to keep now differ from ``kept`` by a block run at least ``MARGIN`` times more.

        Args:
            blocks: The model's blocks, in block order.
            budget: Bytes for kept blocks.
            kept: Indices of the blocks kept now.

        Returns:
            True when the set should change.
        """
        if not budget:
            return False
        kept = set(kept)
        wanted = {b.index for b in self.choose(blocks, budget)}
        joining, leaving = wanted - kept, kept - wanted
        if not joining:
            return False
        least_joining = min(self.runs[i] for i in joining)
        most_leaving = max((self.runs[i] for i in leaving), default=-MARGIN)
        return least_joining >= most_leaving + MARGIN
