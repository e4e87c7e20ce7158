"""``BlockStore``: every block's IO as moves of its ``Residency``, with the figures ``OffloadStats`` reports.

The IO is reads into staging buffers, write-backs and their failures.
Changes user code made to a block in memory that storage cannot take are refused in ``user_changes``.
"""

from __future__ import annotations

import errno
import time
from typing import Sequence

import torch

from ....errors import ChecksumError, ResidencyError, StreamedParameterError
from ...codecs import codec_class
from ...config import SwapConfig
from ...pool import PAGE_SIZE
from ...records import sliceable_checked
from ...tensor_swapper import SwapIn, SwapOut, SwapRecord, TensorSwapper
from ..blocks.placeholders import plain
from ..blocks.residency import Block, Residency, span
from . import user_changes
from .compressed_copy import CompressedCopy


class BlockStore:
    """Owns the blocks' ``TensorSwapper``: the only way from ``swap/params`` to it.

    Through it go the blocks' parameters, their gradients in grads mode, serving from a checkpoint, IO counters and
    closing. Staging buffers: the current block, the prefetch window and one write behind; anything more (gradients
    in grads mode) gets short-lived one-off buffers, so idle pooled memory stays within (prefetch + 2) blocks.

    Args:
        blocks: The blocks, in the order they run.
        prefetch: How many blocks ahead are read.
        config: The async-IO settings (the staging buffers' size and count are set here).
        slack: Bytes more per staging buffer (a block served from a checkpoint is read from the page holding its
            first byte: up to a page more).
    """

    def __init__(self, blocks: Sequence[Block], prefetch: int, config: SwapConfig, slack: int = 0):
        self.blocks = list(blocks)
        self.block_span = max((span(b.masters) for b in self.blocks), default=PAGE_SIZE) + slack
        self.swapper = TensorSwapper(config.replace(chunk_bytes=self.block_span, buffer_count=prefetch + 2))
        encoder = not codec_class(config.codec).identity
        self.copy = CompressedCopy(config.folders[0], config.codec) if encoder else None  # of served blocks
        self.io_wait = 0.0
        self.slice_bytes = 0  # bytes of parameter slices read alone (``slices.read_slices``: experts)
        self.grad_bytes = 0
        self.peak = 0
        self.peak_grad = 0

    # -- setup ------------------------------------------------------------------------------------------------
    def write_masters(self, block: Block) -> SwapOut:
        """Start writing ``block``'s master values (its parameters, or their fp32 masters) to its group."""
        return self.swapper.swap_out({block.group: block.master_tensors()})

    def serve(self, block: Block, records: dict[str, SwapRecord]) -> None:
        """Read ``block``'s group from ``records`` (tensors in place in a checkpoint file) from now on.

        With a codec, from its compressed copy once that is whole (``compressed_copy.py``).
        """
        self.swapper.map_group(block.group, records)
        if self.copy is not None:
            self.copy.add(block.group, records)

    def offload_all(self) -> None:
        """Write every block out (two writes in flight at most).

        The parameters are released only once all are on storage, so a failure leaves the module exactly as it was.
        """
        writes: list[tuple[Block, SwapOut]] = []
        try:
            for block in self.blocks:
                writes.append((block, self.write_masters(block)))
                if len(writes) > 1:
                    self._wait_setup(*writes[-2])
            if writes:
                self._wait_setup(*writes[-1])
        except BaseException:
            try:
                self.swapper.close()
            except OSError:
                pass  # the first failure is the one reported
            raise
        for block in self.blocks:
            block.clear_data()
            block.move(Residency.ON_STORAGE)

    @staticmethod
    def _wait_setup(block: Block, write: SwapOut) -> None:
        try:
            write.wait()
        except OSError as e:
            raise OSError(
                e.errno,
                f"offloading the parameters of block {block.prefix} failed ({e.strerror}); the module is unchanged",
                e.filename,
            ) from e

    # -- reads and releases -----------------------------------------------------------------------------------
    def start_read(self, block: Block, partial: bool = False) -> None:
        """Start reading ``block`` unless it is being read or in memory (a write in flight is waited for).

        A block read partially (without ``block.skip``) and now wanted whole is released and read again.

        Args:
            block: The block to read.
            partial: Leave ``block.skip`` unread (an inference forward whose experts are read on demand).

        Raises:
            ResidencyError: When storage holds nothing valid for it (an earlier write failed).
        """
        if block.read_partly and not partial and block.state in (Residency.READING, Residency.RESIDENT):
            self.release(block, keep_changes=False)  # (a partial read changes nothing)
        if block.state is Residency.READING or block.in_memory:
            return
        self.wait_write(block)
        if self.copy is not None and block.group in self.copy.sources:  # served: from the copy once it is whole
            self.copy.start()
            copied = self.copy.ready(block.group)
            if copied is not None and self.swapper.mapped(block.group) and block.group not in self.copy.used:
                self.swapper.discard(block.group)
                self.swapper.map_group(block.group, copied, encoded=True)
                self.copy.used.add(block.group)
        records = self.swapper.records(block.group)
        if len(records) != len(block.names):
            raise ResidencyError(
                f"block {block.prefix}: nothing valid on storage for its parameters "
                f"{', '.join(block.qualified(n) for n in block.names[:3])}... (an earlier write "
                f"failed and the copy in memory is gone)"
            )
        try:
            partial = partial and bool(block.skip) and self.swapper.packing is None
            partial = partial and all(records[name].codec == "none" for name in block.skip)  # (raw bytes: sliceable)
            partial = partial and all(sliceable_checked(records[name]) for name in block.skip)
            block.read = self.swapper.swap_in([block.group], skip={block.group: block.skip} if partial else None)
        except OSError as e:
            raise self.read_error(block, e) from e
        block.read_partly = partial
        block.move(Residency.READING)
        self.note_peak()

    def materialize(self, block: Block) -> None:
        """Wait for ``block``'s read and point its parameters at the values (no-op when in memory).

        Args:
            block: The block being read.

        Raises:
            ResidencyError: When no read is in flight for it (a bookkeeping bug).
        """
        if block.in_memory:
            return
        if block.state is not Residency.READING:
            block.move(Residency.RESIDENT)  # raises: nothing is being read
        read = block.read
        if read is None:
            raise ResidencyError(
                f"block {block.prefix}: its parameters are {block.state.value} but no read is in "
                f"flight (a bookkeeping bug in deepoffload; please report it)"
            )
        start = time.perf_counter()
        try:
            tensors = read.wait()[block.group]
        except OSError as e:
            block.read = None
            block.move(Residency.ON_STORAGE)
            raise self.read_error(block, e) from e
        finally:
            self.io_wait += time.perf_counter() - start
        block.set_data(tensors)
        block.move(Residency.RESIDENT)
        self.note_peak()

    def read_error(self, block: Block, error: OSError) -> OSError:
        """The error to raise for a failed read of ``block``'s records (naming its parameters and the file)."""
        names = ", ".join(block.qualified(n) for n in block.names)
        path = error.filename or next(iter(self.swapper.records(block.group).values())).file
        if error.errno == errno.ENOENT:
            return FileNotFoundError(
                errno.ENOENT,
                f"the swap file of parameter {block.qualified(block.names[0])} "
                f"(block {block.prefix}: {names}) is missing; it was deleted while "
                f"offloaded, so these parameters are lost",
                path,
            )
        if block.served and isinstance(error, ChecksumError):
            return ChecksumError(
                error.errno,
                f"parameters {names} (block {block.prefix}) are served from {path}, which was replaced, rewritten "
                f"or removed since the model was loaded (its size, modification time or inode differ), so they were "
                f"not read (its values may differ from those loaded). Put the file back as it was, or load the model "
                f"again from the folder as it is now; keep a served checkpoint unchanged while it is in use",
                path,
            )
        return OSError(error.errno, f"reading parameters {names} (block {block.prefix}) failed: {error.strerror}", path)

    def release(self, block: Block, keep_changes: bool = True) -> None:
        """Drop ``block``'s memory if storage holds its values (READING or RESIDENT); other states are kept.

        Args:
            block: The block to release.
            keep_changes: A RESIDENT block whose parameters user code changed in place since it was read (see
                ``Block.changed``) is written back instead (``write_back``), so the change is kept; when a change
                cannot be stored exactly (a ``compute_dtype`` copy, a new shape) the block is released and this
                raises (``StreamedParameterError``), naming it.
        """  # noqa: DOC501 -- ruff takes lost_change(...) for an exception class; it returns the StreamedParameterError
        if block.state not in (Residency.READING, Residency.RESIDENT):
            return
        changed = block.changed() if keep_changes and block.state is Residency.RESIDENT else []
        lost = block.unwritable(changed)
        if changed and not lost:
            self.write_back(block)
            return
        if block.state is Residency.RESIDENT:
            block.clear_data()
        if block.read is not None:
            block.read.release()
            block.read = None
        block.move(Residency.ON_STORAGE)
        if lost:
            raise user_changes.lost_change(
                block, lost, "it was dropped and the parameter holds its stored values again"
            )

    def drop_unwritable(self, block: Block) -> None:
        """Raise if user code changed ``block``'s parameters in a way that cannot be kept (``user_changes``)."""
        user_changes.drop_unwritable(self, block)

    def check_kept_values(self, block: Block) -> None:
        """Run ``drop_unwritable`` before a block in memory is computed with, stepped or copied (``user_changes``)."""
        user_changes.check_kept_values(self, block)

    def pin(self, block: Block) -> None:
        """Make ``block`` resident for good (until ``unpin``).

        Its memory leaves the staging pool, no release drops it, and it steps in memory (``stepped``).
        """
        self.start_read(block)
        self.materialize(block)
        if block.state is not Residency.RESIDENT:
            return  # already PINNED, or KEPT (in memory for good already)
        if block.read is not None:
            block.read.detach()
            block.read = None
        block.move(Residency.PINNED)

    def unpin(self, block: Block) -> None:
        """Write a PINNED block's values (storage is stale once it stepped) and release its memory once written.

        A block whose source is read-only (a checkpoint) is released without a write. A write that cannot start raises
        and leaves it PINNED; one that fails raises and leaves it KEPT.
        """
        if block.state is not Residency.PINNED:
            return
        self.drop_unwritable(block)
        if not block.source.writable:  # unchanged (drop_unwritable raised otherwise): the source holds its values
            block.clear_data()
            block.move(Residency.ON_STORAGE)
            return
        self.write_back(block)
        self.wait_write(block)

    def stepped(self, block: Block) -> None:
        """Keep or write ``block``'s new values after its optimizer step.

        A PINNED block keeps its new values in memory (its compute copies are cast again); any other starts writing
        them back (released once written).
        """
        if block.state is Residency.PINNED:
            block.refresh_compute()
        else:
            self.write_back(block)

    def keep(self, block: Block) -> None:
        """Keep ``block``'s values in memory until written: they changed and storage does not have them.

        Used when a step failed half-way.
        """
        if block.read is not None:
            block.read.detach()  # the values stay in memory, outside the pool
            block.read = None
        if block.state is Residency.RESIDENT:
            block.move(Residency.KEPT)

    def read_copy(self, block: Block) -> dict[str, torch.Tensor]:
        """Copies of the block's master values (from memory when in memory, else read and released).

        A change to a block in memory that its masters cannot take raises (see ``drop_unwritable``) instead of going
        unseen.

        Args:
            block: The block to copy.

        Returns:
            The copies by parameter name.
        """
        if block.in_memory:
            self.check_kept_values(block)
            return {name: t.clone() for name, t in block.master_tensors().items()}
        self.start_read(block)
        try:
            self.materialize(block)
            return {name: t.clone() for name, t in block.master_tensors().items()}
        finally:
            self.release(block)

    def restore(self, block: Block, tensors: dict[str, torch.Tensor]) -> None:
        """End offloading of ``block``: its parameters hold ``tensors`` (master values) from now on."""
        self.release(block, keep_changes=False)
        block.move(Residency.RESTORED)
        for name, param in zip(block.names, block.params):
            plain(param)
            param.data = tensors[name]

    # -- writes -----------------------------------------------------------------------------------------------
    def _start_write(self, block: Block, staged: SwapIn | None) -> None:
        tensors = block.master_tensors()
        block.write = self.swapper.swap_out({block.group: tensors}, staged=staged)
        block.written = tensors
        block.clear_data()  # the write holds the bytes now; the parameters let go
        block.move(Residency.WRITING)
        self.note_peak()

    def wait_write(self, block: Block) -> None:
        """Wait for ``block``'s write in flight, if any, and release its memory; a failed write leaves it KEPT.

        Args:
            block: The block being written.

        Raises:
            ResidencyError: When it is WRITING without a write (a bookkeeping bug).
            OSError: When the write fails (the values stay in memory; ``flush()`` writes them later).
        """
        if block.state is not Residency.WRITING:
            return
        write = block.write
        if write is None:
            raise ResidencyError(
                f"block {block.prefix}: its parameters are {block.state.value} but no write is in "
                f"flight (a bookkeeping bug in deepoffload; please report it)"
            )
        start = time.perf_counter()
        try:
            write.wait()
        except OSError as e:
            block.set_data(block.written)  # the bytes stay in memory, where they are the only valid copy
            block.write, block.written = None, {}
            block.move(Residency.KEPT)
            raise OSError(
                e.errno,
                f"writing the parameters of block {block.prefix} failed ({e.strerror}); they "
                f"stay in memory; free space and call flush()",
                e.filename,
            ) from e
        else:  # (interrupted, e.g. by Ctrl-C: still WRITING with its write, which the next wait collects)
            block.write, block.written = None, {}
            block.move(Residency.ON_STORAGE)
        finally:
            self.io_wait += time.perf_counter() - start
            self.note_peak()

    def wait_writes(self) -> None:
        """Wait for every parameter write in flight; raise the first failure (those blocks are KEPT)."""
        error = None
        for block in self.blocks:
            try:
                self.wait_write(block)
            except OSError as e:
                error = error or e
        if error is not None:
            raise error

    def write_back(self, block: Block) -> None:
        """Start writing the in-memory (RESIDENT, KEPT or PINNED) block's values.

        Its memory is released when the write succeeds. One block write in flight at most.

        Args:
            block: The block to write.

        Raises:
            StreamedParameterError: When the block's source is read-only (served from a checkpoint).
        """
        read_only = block.source.read_only()
        if read_only is not None:
            raise StreamedParameterError(
                f"block {block.prefix}: its parameters are {read_only}, which is never written: offload without "
                f"serve_from_checkpoint= to change or train them"
            )
        self.wait_writes()
        staged, block.read = block.read, None
        try:
            self._start_write(block, staged=staged)
        except BaseException:
            if block.state is Residency.RESIDENT:
                block.move(Residency.KEPT)  # the values stay where they are (the staging buffer left the pool)
            raise

    def flush_kept(self) -> OSError | None:
        """Write out every KEPT block and wait; return the first failure (those stay KEPT)."""
        error = None
        for block in self.blocks:
            if block.state is Residency.KEPT:
                try:
                    self._start_write(block, staged=None)
                    self.wait_write(block)
                except OSError as e:
                    error = error or e
        return error

    # -- figures ----------------------------------------------------------------------------------------------
    def timed_wait(self, read: SwapIn) -> dict:
        """``read.wait()``, its time counted in ``io_wait``.

        Args:
            read: The read in flight.

        Returns:
            What the read returns: the tensors by group and name.
        """
        start = time.perf_counter()
        try:
            return read.wait()
        finally:
            self.io_wait += time.perf_counter() - start

    def resident_bytes(self) -> int:
        """The blocks' parameter bytes in memory now."""
        return sum(b.resident_bytes() for b in self.blocks)

    def note_peak(self) -> None:
        """Raise the peaks to what is in memory now."""
        self.peak = max(self.peak, self.resident_bytes())
        self.peak_grad = max(self.peak_grad, self.grad_bytes)

    def reset_peak(self) -> None:
        """Start the peaks afresh from what is in memory now."""
        self.peak = self.resident_bytes()
        self.peak_grad = self.grad_bytes

    # -- gradients on storage (grads mode) ----------------------------------------------------------------------
    def hold_for_change(self, block: Block) -> bool:
        """Bring ``block``'s stored values into memory for a change made outside training (``user_changes``)."""
        return user_changes.hold_for_change(self, block)

    def fit_staging(self, block: Block) -> None:
        """Grow the block span and the staging pool to ``block``'s tensors when they outgrew them.

        That happens after a dtype move to a wider dtype.
        """
        needed = span(block.masters)
        if needed > self.block_span:
            self.block_span = needed
            self.swapper.pool.fit(needed)

    def has_stored_grads(self, block: Block) -> bool:
        """Whether storage holds gradients of ``block`` (grads mode)."""
        return bool(self.swapper.records(block.grad_group))

    def read_grads(self, block: Block) -> SwapIn:
        """Start reading ``block``'s stored gradients."""
        return self.swapper.swap_in([block.grad_group])

    def write_grads(self, block: Block, grads: dict[str, torch.Tensor]) -> SwapOut:
        """Start writing ``grads`` (by parameter name) as ``block``'s stored gradients."""
        return self.swapper.swap_out({block.grad_group: grads})

    def discard_grads(self, block: Block) -> None:
        """Forget ``block``'s stored gradients."""
        self.swapper.discard(block.grad_group)

    # -- counters and closing -------------------------------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        """Bytes read from storage so far (parameters, experts read alone and gradients)."""
        return self.swapper.bytes_read + self.slice_bytes

    @property
    def bytes_written(self) -> int:
        """Bytes written to the swap files so far (parameters and gradients)."""
        return self.swapper.bytes_written

    def stored_bytes(self) -> int:
        """Bytes the blocks' swap files hold now."""
        return self.swapper.stored_bytes()

    def staging_bytes(self) -> int:
        """Bytes of staging memory the swapper's pool holds now."""
        return self.swapper.pool.held_bytes()

    def close(self) -> None:
        """Close the swapper (its files are removed) and stop a compressed copy still being written."""
        if self.copy is not None:
            self.copy.close()
        self.swapper.close()
