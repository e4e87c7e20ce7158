"""Changes user code makes in place to a block's parameters in memory: refused when storage cannot take them.

A RESIDENT block changed in place is written back on release (``BlockStore.release``); a change its masters cannot
take (a ``compute_dtype`` copy, a new shape) is dropped and raised here (``StreamedParameterError``), naming the
parameter. Changes made outside training (``load_state_dict``, dtype moves) first bring the block into memory
(``hold_for_change``). ``BlockStore`` keeps ``drop_unwritable``, ``check_kept_values`` and ``hold_for_change`` as
its entry points.
"""

from __future__ import annotations

from typing import Protocol

from ....errors import StreamedParameterError
from ..blocks.residency import Block, Residency


class Store(Protocol):
    """What these checks ask of the blocks' store (``store.BlockStore``, which imports this module)."""

    blocks: list[Block]

    def release(self, block: Block) -> None:
        """Release ``block`` (writing a change it holds)."""
        ...

    def drop_unwritable(self, block: Block) -> None:
        """Refuse, for ``block``, changes storage cannot hold."""
        ...

    def check_kept_values(self, block: Block) -> None:
        """Refuse, before ``block`` is used, a change its masters cannot take."""
        ...

    def wait_write(self, block: Block) -> None:
        """Wait for ``block``'s write in flight."""
        ...

    def start_read(self, block: Block) -> None:
        """Start reading ``block``."""
        ...

    def materialize(self, block: Block) -> None:
        """Make ``block`` resident once its read is done."""
        ...


def lost_change(block: Block, lost: dict[str, str], outcome: str) -> StreamedParameterError:
    """The error for a change to ``block``'s parameters that cannot be written to storage (``lost``: name -> why).

    Args:
        block: The block.
        lost: The parameters changed, by name, with the reason each cannot be written.
        outcome: What became of the change.

    Returns:
        The error, to raise.
    """
    name, reason = next(iter(lost.items()))
    return StreamedParameterError(
        f"parameter {block.qualified(name)} was changed in place while its block was in memory "
        f"(p.mul_() under torch.no_grad(), nn.init, load_state_dict, p.data = ... after a "
        f"forward), but {reason}, so the change cannot be written to storage: {outcome}. Change "
        f"or load weights before offload_parameters() or after off.close()"
    )


def drop_unwritable(store: Store, block: Block) -> None:
    """Raise if user code changed ``block``'s parameters in a way that cannot be kept, after dropping the change.

    See ``BlockStore.release``. A RESIDENT block is released; an in-memory one's compute copies are cast again from its
    masters. A master of another shape, dtype or device in a block held in memory is left for the caller to put
    back (its values may exist nowhere else). The error is a ``StreamedParameterError`` naming the parameter and
    what became of the change.

    Args:
        store: The blocks' store.
        block: The block to check.
    """  # noqa: DOC501 -- ruff takes lost_change(...) for an exception class; it returns the StreamedParameterError
    lost = block.unwritable(block.changed()) if block.in_memory else {}
    if not lost:
        return
    if block.state is Residency.RESIDENT:
        store.release(block)  # raises
    if not block.source.writable and block.state is Residency.PINNED:  # the source holds its values
        block.clear_data()
        block.move(Residency.ON_STORAGE)
        raise lost_change(block, lost, "it was dropped and the parameter holds its stored values again")
    if all(block.masters[block.names.index(name)] is not block.params[block.names.index(name)] for name in lost):
        block.refresh_compute()
        raise lost_change(block, lost, "it was dropped and the parameter holds the cast of its master values again")
    raise lost_change(
        block, lost, "it is left in place: give the parameter back a tensor of its stored shape, dtype and device"
    )


def check_kept_values(store: Store, block: Block) -> None:
    """Run ``drop_unwritable`` before a block in memory is computed with, stepped or copied.

    No release checks a pinned block, hence this. When it raises, the other blocks in memory drop their changes
    too (a ``load_state_dict`` reached them all), so the error comes once, with a note naming those blocks.
    """
    if not block.in_memory:
        return
    try:
        store.drop_unwritable(block)
    except RuntimeError as error:
        also = []
        for other in store.blocks:
            if other.in_memory:
                try:
                    store.drop_unwritable(other)
                except RuntimeError:
                    also.append(other.prefix)  # reported on the first one's error, not raised again
        if also and hasattr(error, "add_note"):  # (Python 3.11+, as in swap/optimizer.py)
            error.add_note(f"changes dropped the same way in blocks {', '.join(also)}")
        raise


def hold_for_change(store: Store, block: Block) -> bool:
    """Bring ``block``'s stored values into memory for a change made outside training.

    Its pending write is waited for and changes made before are checked first.

    Args:
        store: The blocks' store.
        block: The block to change.

    Returns:
        Whether it was in memory already (if not, release it with ``keep_changes=False`` when the change fails).
    """
    store.wait_write(block)
    store.check_kept_values(block)  # a change made before, which the masters cannot take, raises first
    held = block.in_memory
    if not held:
        store.start_read(block)
        store.materialize(block)
    return held
