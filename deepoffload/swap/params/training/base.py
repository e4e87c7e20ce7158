"""What every training mode shares: stepping a resident block and gathering its gradients.

The interface ``ParameterOffload`` calls is defined here too. The modes themselves are ``Fused`` (``training``) and
``Grads`` (``grads_mode``); ``training.MODES`` names them.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from ....errors import StreamedParameterError
from ...optimizer import OffloadedOptimizer
from ..blocks.residency import Block
from ..storage.store import BlockStore


class Training:
    """Shared by both modes: stepping a resident block and gathering its gradients.

    Args:
        module: The model.
        store: The blocks' store.
        prefetch: How many blocks ahead are read.
        rest: The parameters outside blocks.
        block_optimizer: The optimizer of the blocks' master weights (None: inference, or all blocks frozen).
        rest_optimizer: The optimizer of the parameters outside blocks (None: none of them trains).
    """

    name = ""
    defers_nested = False  # calls back-propagated in nested passes (reentrant checkpoint) step in step()

    def __init__(
        self,
        module: nn.Module,
        store: BlockStore,
        prefetch: int,
        rest: list[nn.Parameter],
        block_optimizer: OffloadedOptimizer | None,
        rest_optimizer: OffloadedOptimizer | None,
    ):
        self.module, self.store, self.prefetch, self.rest = module, store, prefetch, rest
        self.block_optimizer, self.rest_optimizer = block_optimizer, rest_optimizer
        self.optimizer_seconds = 0.0
        # data_parallel=: (block, complete gradients by name) -> those averaged across the ranks (fused mode), or a
        # call returning them, the reduction in flight meanwhile (grads mode)
        self.average: Callable[[Block, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
        self.average_start: Callable[[Block, dict[str, torch.Tensor]], Callable[[], dict]] | None = None

    # -- the interface ParameterOffload uses ------------------------------------------------------------------
    def before_backward(self, block: Block, last: bool) -> None:
        """The block is about to back-propagate.

        Args:
            block: The block.
            last: Whether it back-propagates for the last time in this pass.
        """

    def after_backward(self, block: Block) -> None:
        """The block's gradients for this pass are complete (its last backward); it is still resident.

        Args:
            block: The block.

        Raises:
            NotImplementedError: Always: each mode defines it.
        """
        raise NotImplementedError

    def end_step(self) -> None:
        """``ParameterOffload.step()`` finished a training step."""

    def step(self, clip_grad_norm: float | None, norm_type: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Step the blocks as the mode requires.

        Args:
            clip_grad_norm: Clip by the global norm to this (None: no clipping).
            norm_type: The norm's order.

        Returns:
            The total gradient norm and the clip coefficient for the other parameters' gradients (both None without
            clipping).

        Raises:
            NotImplementedError: Always: each mode defines it.
        """
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Drop every gradient of the blocks, in memory and on storage."""
        for block in self.store.blocks:
            block.grads, block.partial, block.deferred, block.grads_stored = {}, {}, False, False
            for param in block.params:
                param.grad = None

    def finish_writes(self) -> None:
        """Wait for gradient writes in flight (raise the first failure)."""

    # -- helpers ----------------------------------------------------------------------------------------------
    def stepping_optimizer(self, block: Block) -> OffloadedOptimizer:
        """The blocks' optimizer, to step or prefetch for the trainable ``block``.

        Args:
            block: The block to step.

        Returns:
            The optimizer of the blocks' master weights.

        Raises:
            StreamedParameterError: When there is none (``ParameterOffload`` refuses a trainable block's backward
                before that).
        """
        if self.block_optimizer is None:
            raise StreamedParameterError(
                f"block {block.prefix}: its parameters are trained but offload_parameters() "
                f"got no optimizer: pass train=TrainOptions(optimizer) to train, or freeze the parameters "
                f"(requires_grad_(False))"
            )
        return self.block_optimizer

    def step_block(self, block: Block, grads: dict[str, torch.Tensor]) -> None:
        """Step the block's resident masters with ``grads`` (master dtype), then start writing them back.

        A pinned block keeps them in memory instead (``BlockStore.stepped``).

        Args:
            block: The block, resident.
            grads: Its gradients by parameter name.
        """
        for name, master in zip(block.names, block.masters):
            master.grad = grads.get(name)
        start = time.perf_counter()
        try:
            self.stepping_optimizer(block).step()
            block.steps += 1
        except BaseException:
            self.store.keep(block)  # the updated values stay in memory, the only valid copy
            raise
        finally:
            self.optimizer_seconds += time.perf_counter() - start
            for param, master in zip(block.params, block.masters):
                master.grad = None
                param.grad = None
        self.store.stepped(block)

    @staticmethod
    def block_grads(block: Block, consume: bool = True) -> dict[str, torch.Tensor]:
        """The block's in-memory gradients in the master dtype: ``param.grad`` added to any kept after a failed write.

        Args:
            block: The block.
            consume: The block holds none of those kept afterwards.

        Returns:
            The gradients by parameter name.
        """
        grads = {
            name: (param.grad if param is master else param.grad.to(master.dtype))
            for name, param, master in zip(block.names, block.params, block.masters)
            if param.grad is not None
        }
        kept = block.grads
        if consume:
            block.grads = {}
        for name, grad in kept.items():
            grads[name] = torch.add(grad, grads[name]) if name in grads else grad
        return grads
