"""The training step of a ``ParameterOffload`` after backward, and the gradients and writes around it.

``Stepper.step`` streams every block through its optimizer step in grads mode or waits for the blocks' write-backs in
fused mode (clipping by the global norm first when asked), then steps the parameters outside blocks; ``zero_grad``
clears the gradients outside blocks and the blocks' stored ones; ``flush`` waits for every write and writes out blocks
kept in memory after a failed write. The ``ParameterOffload`` methods of these names are their entry points.
"""

from __future__ import annotations

import torch

from ... import grad_norm
from ..blocks.residency import Block
from ..storage.store import BlockStore
from .base import Training
from .optimizers import Optimizers


class Stepper:
    """Steps after backward, over the parts of a ``ParameterOffload`` it is given.

    Args:
        blocks: The blocks.
        store: Their store.
        training: The training mode (fused or grads).
        rest: The parameters outside blocks.
        optimizers: The blocks' and the rest's optimizers.
    """

    def __init__(self, blocks: list[Block], store: BlockStore, training: Training, rest: list, optimizers: Optimizers):
        self.blocks, self.store, self.training, self.rest, self.optimizers = blocks, store, training, rest, optimizers

    def guard_grads(self) -> None:
        """Refuse reads of the gradients of every block not in memory (``Block.guard_grads``)."""
        for block in self.blocks:
            block.guard_grads()

    def step(self, clip_grad_norm: float | None, norm_type: float) -> torch.Tensor | None:
        """``ParameterOffload.step``: the total norm before clipping with ``clip_grad_norm``, else None.

        Args:
            clip_grad_norm: Clip every gradient by the global norm first (grads mode); None: no clipping.
            norm_type: The norm's order.

        Returns:
            With ``clip_grad_norm``, the total norm before clipping, else None.

        Raises:
            ValueError: When there is no optimizer.
        """
        rest_optimizer = self.optimizers.rest
        if self.optimizers.block is None and rest_optimizer is None:
            raise ValueError("step(): offload_parameters() got no optimizer: pass train=TrainOptions(optimizer)")
        if clip_grad_norm is not None:
            grad_norm.check_clip_args(clip_grad_norm, norm_type)
        for block in self.blocks:
            self.store.check_kept_values(block)  # a change a pinned block's masters cannot take raises before a step
        for block in self.blocks:
            block.unguard_grads()  # blocks in memory step with plain parameters
        try:
            total, coefficient = self.training.step(clip_grad_norm, norm_type)
            self.training.end_step()
            self.store.wait_writes()
        finally:
            self.guard_grads()  # gradients a failure left away stay refused
            if self.optimizers.block is not None:  # state read ahead for parameters that got no gradient this step
                self.optimizers.block.pipeline.drop_prefetched()
        if rest_optimizer is not None:
            if coefficient is not None:
                grad_norm.scale_([p.grad for p in self.rest if p.grad is not None], coefficient)
            rest_optimizer.step()
        return total

    def zero_grad(self, set_to_none: bool) -> None:
        """``ParameterOffload.zero_grad``: the gradients outside blocks and the blocks' gradients on storage.

        Args:
            set_to_none: For the gradients outside blocks: None rather than zero.
        """
        self.training.finish_writes()
        if self.optimizers.rest is not None:
            self.optimizers.rest.zero_grad(set_to_none)
        self.training.zero_grad()
        self.guard_grads()

    def flush(self) -> None:
        """``ParameterOffload.flush``: every write waited for; the first failure raised once all were tried.

        Raises:
            OSError: The first write that failed.
        """
        error = None
        for action in (self.training.finish_writes, self.store.wait_writes):
            try:
                action()
            except OSError as e:
                error = error or e
        error = error or self.store.flush_kept()
        if error is not None:
            raise error
