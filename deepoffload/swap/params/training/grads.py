"""Grads mode: each block's gradients go to storage; ``step()`` streams the blocks through their optimizer step.

The gradients are accumulated on storage (a pinned block's stay in memory); ``step()`` streams weights and gradients
in block by block, optionally clipping by the global norm first (two streamed passes).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import torch

from ....errors import StreamedParameterError
from ... import grad_norm
from ...pool import trim_heap
from ...tensor_swapper import SwapIn, SwapOut
from ..blocks.residency import Block, Residency, nbytes
from .base import Training


class Grads(Training):
    """Sends each block's gradients to storage; ``step()`` streams the blocks through their optimizer step.

    Args:
        *args: ``Training``'s arguments.
        **kwargs: ``Training``'s keyword arguments.
    """

    name = "grads"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grad_writes: list[tuple[Block, SwapOut, dict]] = []
        # the block whose average is in flight: (block, its result, had stored gradients, bytes)
        self.averaging: tuple[Block, Callable[[], dict], bool, int] | None = None
        self.unscaled = False  # a GradScaler unscaled the stored gradients (``scaling``); step() or zero_grad() next

    def before_backward(self, block: Block, last: bool) -> None:
        """Refuse a backward onto gradients a ``GradScaler`` unscaled and no ``step()``/``zero_grad()`` consumed.

        Args:
            block: The block.
            last: Whether it back-propagates for the last time in this pass.

        Raises:
            StreamedParameterError: After ``scaler.unscale_``/``scaler.step`` on this offload's gradients, before
                ``step()`` or ``zero_grad()`` (a step the scaler skipped leaves them stored; ``model.zero_grad()``
                does not reach them).
        """
        if self.unscaled and block.trainable:
            raise StreamedParameterError(
                f"block {block.prefix}: backward after a GradScaler unscaled the stored gradients (scaler.unscale_ or "
                f"scaler.step) and before StreamedOptimizer.step() or zero_grad(): after a step the scaler skipped "
                f"they are still stored, and model.zero_grad() does not reach them, so they would be added to this "
                f"backward's. Call opt.zero_grad() (StreamedOptimizer) or off.zero_grad() after scaler.update()"
            )

    def after_backward(self, block: Block) -> None:
        """Send the block's gradients to storage (added to those already there).

        ``param.grad`` is freed now and given back if the write fails. A PINNED block keeps them in memory
        (``block.grads``, master dtype, added to those of earlier passes in the same order): no gradient bytes are
        written or read for it. Under ``data_parallel=`` the sum is averaged across the ranks first, asynchronously: it
        is written (or kept) when the next block's backward is done (or at ``finish_writes``), so the reduction overlaps
        that backward.
        """
        grads = self.block_grads(block)
        self.store.grad_bytes = nbytes(grads.values()) + self._bytes_in_flight()
        self.store.note_peak()
        self._wait_writes()
        stored_before = bool(grads) and self.store.has_stored_grads(block)
        if stored_before:  # earlier passes' gradients, added to (a block pinned since keeps the sum in memory)
            read = self.store.read_grads(block)
            try:
                stored = self.store.timed_wait(read)[block.grad_group]
                # copies out of the staging buffer of those without a new gradient in this pass
                grads = {
                    **{name: t.clone() for name, t in stored.items() if name not in grads},
                    **{name: torch.add(stored[name], grad) if name in stored else grad for name, grad in grads.items()},
                }
            finally:
                read.release()
        if self.average_start is None:
            self._keep_or_write(block, grads, stored_before)
        else:  # the accumulated sum, as DDP reduces the accumulated param.grad
            previous, self.averaging = self.averaging, None
            self.averaging = (block, self.average_start(block, grads), stored_before, nbytes(grads.values()))
            for param in block.params:
                param.grad = None
            if previous is not None:
                self._keep_or_write(previous[0], previous[1](), previous[2])
        self.store.release(block)

    def _keep_or_write(self, block: Block, grads: dict[str, torch.Tensor], stored_before: bool) -> None:
        if grads:
            if block.state is Residency.PINNED:
                if stored_before:
                    self.store.discard_grads(block)
                block.grads, block.grads_stored = grads, False
            else:
                write = self.store.write_grads(block, grads)
                block.grads_stored = True
                self.grad_writes.append((block, write, grads))
            self.store.grad_bytes = sum(nbytes(b.grads.values()) for b in self.store.blocks) + self._bytes_in_flight()
            self.store.note_peak()
            for param in block.params:
                param.grad = None

    def _bytes_in_flight(self) -> int:
        """Gradient bytes being written, or being averaged across the ranks."""
        return sum(nbytes(g.values()) for _, _, g in self.grad_writes) + (
            self.averaging[3] if self.averaging is not None else 0
        )

    def finish_writes(self) -> None:
        """Finish the average in flight and wait for gradient writes (raise the first failure)."""
        averaging, self.averaging = self.averaging, None
        if averaging is not None:
            self._keep_or_write(averaging[0], averaging[1](), averaging[2])
        self._wait_writes()

    def _wait_writes(self) -> None:
        error = None
        while self.grad_writes:
            block, write, grads = self.grad_writes.pop(0)
            start = time.perf_counter()
            try:
                write.wait()
            except OSError as e:
                block.grads = grads  # the bytes on storage are unknown now: memory holds the only copy
                error = error or OSError(
                    e.errno,
                    f"writing the gradients of block {block.prefix} failed "
                    f"({e.strerror}); they stay in memory and step() uses them",
                    e.filename,
                )
            finally:
                self.store.io_wait += time.perf_counter() - start
        self.store.grad_bytes = sum(nbytes(b.grads.values()) for b in self.store.blocks)
        if error is not None:
            raise error

    def zero_grad(self) -> None:
        """Drop every gradient of the blocks, in memory and on storage (after the writes in flight)."""
        self.unscaled = False
        self.finish_writes()
        for block in self.store.blocks:
            self.store.discard_grads(block)
        super().zero_grad()

    def blocks_with_grads(self) -> list[Block]:
        """Finish the gradient writes, release the blocks and list those holding gradients.

        Returns:
            The blocks with gradients on storage, or in memory after a failed write, in order.
        """
        self.finish_writes()
        for block in self.store.blocks:
            self.store.release(block)
        return [
            b
            for b in self.store.blocks
            if self.store.has_stored_grads(b) or b.grads or any(p.grad is not None for p in b.params)
        ]

    def stream_grads(
        self,
        todo: list[Block],
        start_also: Callable[[Block], None] | None = None,
        prepare: Callable[[Block], None] | None = None,
        discard: bool = False,
    ) -> Iterator[tuple[Block, dict[str, torch.Tensor]]]:
        """Yield each block of ``todo`` with its gradients (master dtype).

        The gradients are read from storage ``prefetch`` blocks ahead (pooled staging buffers, valid until the next
        block is asked for) or, after a failed write dropped the file, taken from memory.

        Args:
            todo: The blocks, in order.
            start_also: ``start_also(block)`` starts the block's other reads along with its gradients'.
            prepare: ``prepare(block)`` runs before its gradients are taken (a failure there loses none of those
                kept in memory).
            discard: Delete each block's stored gradients once the caller is done with them.

        Yields:
            (block, its gradients by parameter name).
        """
        reads: dict[int, SwapIn] = {}

        def start(k: int) -> None:
            if k < len(todo):
                block = todo[k]
                if start_also is not None:
                    start_also(block)
                if self.store.has_stored_grads(block):
                    reads[block.index] = self.store.read_grads(block)

        try:
            for k in range(self.prefetch + 1):
                start(k)
            for k, block in enumerate(todo):
                read = reads.pop(block.index, None)
                try:
                    if prepare is not None:
                        prepare(block)
                    grads = self.block_grads(block, consume=discard)
                    if read is not None:
                        grads = self.store.timed_wait(read)[block.grad_group]
                    yield block, grads
                finally:
                    if read is not None:
                        read.release()
                if discard:
                    self.store.discard_grads(block)
                    block.grads_stored = False
                start(k + 1 + self.prefetch)
        finally:
            for read in reads.values():
                read.release()

    def global_norm(self, todo: list[Block], norm_type: float) -> torch.Tensor:
        """The norm of every gradient, the blocks' streamed from storage one window at a time.

        Taken exactly as ``torch.nn.utils.clip_grad_norm_(module.parameters())`` takes it (see ``grad_norm``).

        Args:
            todo: The blocks holding gradients.
            norm_type: The norm's order.

        Returns:
            The total norm (a 0-dim tensor).
        """
        norms: dict[int, torch.Tensor] = {}
        rest = [(p, p.grad) for p in self.rest if p.grad is not None]
        norms.update(zip((id(p) for p, _ in rest), grad_norm.tensor_norms([g for _, g in rest], norm_type)))
        for block, grads in self.stream_grads(todo):
            params = [p for name, p in zip(block.names, block.params) if name in grads]
            values = grad_norm.tensor_norms([grads[name] for name in block.names if name in grads], norm_type)
            norms.update(zip(map(id, params), values))
        ordered = [norms[id(p)] for p in self.module.parameters() if id(p) in norms]
        return grad_norm.total_norm(ordered, norm_type)

    def step(self, clip_grad_norm: float | None, norm_type: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Stream the blocks with gradients through their optimizer step, clipping by the global norm first.

        Args:
            clip_grad_norm: Clip by the global norm to this (None: no clipping).
            norm_type: The norm's order.

        Returns:
            The total gradient norm and the clip coefficient for the other parameters' gradients (both None without
            clipping).
        """
        total = coefficient = None
        if clip_grad_norm is not None:
            total = self.global_norm(self.blocks_with_grads(), norm_type)
            coefficient = grad_norm.clip_coefficient(clip_grad_norm, total)
        if self.block_optimizer is not None:
            self._step_streamed(self.blocks_with_grads(), coefficient)
        self.unscaled = False
        return total, coefficient

    def _step_streamed(self, todo: list[Block], coefficient: torch.Tensor | None) -> None:
        """Weights and gradients in, (clip), step, weights out, block by block (``prefetch`` ahead)."""

        def start_also(block: Block) -> None:
            self.store.start_read(block)
            self.stepping_optimizer(block).prefetch(m for m in block.masters if m.requires_grad)

        for block, grads in self.stream_grads(todo, start_also, prepare=self.store.materialize, discard=True):
            if coefficient is not None:
                grad_norm.scale_([grads[name] for name in block.names if name in grads], coefficient)
            self.step_block(block, grads)
            del grads
            trim_heap()  # the step's block-sized temporaries, freed now: see trim_heap
