"""Training modes: what happens to a block's gradients once its backward is complete, and what ``step()`` does.

- ``Fused``: the block's optimizer step runs inside backward; its weights are written back (kept in memory when
  pinned) and gradients freed.
- ``Grads``: the block's gradients go to storage (accumulated there; a pinned block's stay in memory); ``step()``
  streams weights and gradients in block by block, optionally clipping by the global norm first (two streamed
  passes).

Both talk to the blocks only through ``BlockStore`` (residency moves) and to the optimizers through
``OffloadedOptimizer``'s public methods. What both share is ``training_mode.Training``; ``Grads`` is in
``grads_mode``; this module holds ``Fused`` and ``MODES``, the table of both.
"""

from __future__ import annotations

import sys

from ....errors import StreamedParameterError, UnsupportedError
from ..blocks.residency import Block, nbytes
from .base import Training
from .grads import Grads


def accumulating() -> bool:
    """Whether accelerate's ``Accelerator.accumulate()`` is inside a step's micro-batches that do not step.

    Returns:
        True when accelerate's ``GradientState`` says gradients are not synced; False when accelerate is not in use.
    """
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    if not shared:
        return False
    return shared.get("sync_gradients", True) is False


class Fused(Training):
    """Steps each block inside its last backward of the pass.

    A block called inside a reentrant ``torch.utils.checkpoint`` is back-propagated once per call, each in a nested pass
    that cannot tell whether another call of the block is still to come: its gradients stay in memory and it steps in
    ``step()``.
    """

    name = "fused"
    defers_nested = True

    def before_backward(self, block: Block, last: bool) -> None:
        """Refuse a second step of the block before ``step()``; on its last backward start reading its state.

        The optimizer state is read on the block's last backward of the pass, so the step that follows finds it in
        memory.

        Args:
            block: The block.
            last: Whether it back-propagates for the last time in this pass.

        Raises:
            UnsupportedError: When accelerate accumulates gradients (fused mode cannot).
            StreamedParameterError: When the block already stepped since the last ``step()`` (a second backward).
        """
        if not (last and block.trainable):
            return
        if accumulating():
            raise UnsupportedError(
                f"block {block.prefix}: accelerate accumulates gradients here (Accelerator("
                f"gradient_accumulation_steps>1) inside accelerator.accumulate(), before its step), but "
                f"in fused mode each block steps inside its backward. Use offload_parameters(..., "
                f'train=TrainOptions(optimizer, mode="grads")) to accumulate gradients'
            )
        if block.stepped:
            raise StreamedParameterError(
                f"block {block.prefix}: two backward passes per step() in fused mode (gradient "
                f"accumulation, or a second loss): each block steps inside its backward, so the "
                f"second pass would step it again. Call step() after each backward, or use "
                f'offload_parameters(..., train=TrainOptions(optimizer, mode="grads")) to accumulate gradients'
            )
        self.stepping_optimizer(block).prefetch(m for m in block.masters if m.requires_grad)

    def after_backward(self, block: Block) -> None:
        """Step the trainable block now (its weights written back), else release it."""
        if not block.trainable:
            self.store.release(block)
            return
        self._step(block)

    def _step(self, block: Block) -> None:
        block.stepped = True
        grads = self.block_grads(block)
        if self.average is not None:
            grads = self.average(block, grads)
        self.store.grad_bytes = nbytes(grads.values())
        self.store.note_peak()
        self.step_block(block, grads)
        self.store.grad_bytes = 0

    def end_step(self) -> None:
        """A new step begins: every block may step again."""
        for block in self.store.blocks:
            block.stepped = False

    def step(self, clip_grad_norm: float | None, norm_type: float) -> tuple[None, None]:
        """Step the blocks whose gradients were deferred to ``step()`` (reentrant checkpoint); no clipping.

        Args:
            clip_grad_norm: Must be None: clipping is impossible in fused mode.
            norm_type: Unused.

        Returns:
            (None, None): no norm, no clip coefficient.

        Raises:
            ValueError: When ``clip_grad_norm`` is given.
        """
        if clip_grad_norm is not None:
            raise ValueError(
                "step(clip_grad_norm=...): clipping by the global gradient norm is impossible in "
                "fused mode (each block already stepped inside backward, before the other blocks' "
                'gradients existed); use offload_parameters(..., train=TrainOptions(optimizer, mode="grads")) to clip'
            )
        deferred = [b for b in self.store.blocks if b.deferred]
        for k, block in enumerate(deferred):
            block.deferred = False
            if not block.trainable:
                block.partial = {}
                continue
            self.store.start_read(block)
            self.stepping_optimizer(block).prefetch(m for m in block.masters if m.requires_grad)
            if k + 1 < len(deferred):
                self.store.start_read(deferred[k + 1])
            self.store.materialize(block)
            block.restore_grads()
            self._step(block)
        return None, None


MODES: dict[str, type[Training]] = {"fused": Fused, "grads": Grads}
