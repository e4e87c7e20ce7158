"""Loss scaling (``torch.amp.GradScaler``) over streamed blocks: their gradients unscaled and checked where they are.

In grads mode a block's gradients wait on storage (or in memory, pinned) until ``step()``, after the whole backward,
so a ``GradScaler`` can treat them exactly as in memory: ``scaler.unscale_(opt)`` (and ``scaler.step(opt)``, which
calls it) reaches ``StreamedOptimizer.deepoffload_unscale_`` (see ``scaled_losses``), which reads each block's
gradients, unscales them and records any inf/NaN with torch's own kernel, and writes them back; ``scaler.step`` then
skips ``step()`` on an overflow, so no weight, optimizer state or weight file changes
(tests/swap/params/test_params_fp16.py). Fused mode steps each block inside backward, before the scaler can see it:
``ParameterOffload.scaled_loss_error`` refuses its scaled losses.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch

from ....errors import StreamedParameterError
from ...optimizer import OffloadedOptimizer
from ...scaled_losses import unscale_
from ..blocks.residency import Block
from .base import Training
from .grads import Grads


def unscale_blocks(
    training: Training,
    blocks: list[Block],
    optimizers: list[OffloadedOptimizer],
    unscale_groups: Callable[[Any], dict[torch.device, torch.Tensor]],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    allow_fp16: bool,
) -> dict[torch.device, torch.Tensor]:
    """Unscale every gradient and record overflows, as ``GradScaler._unscale_grads_`` does in memory.

    The scaler's own pass (``unscale_groups``) runs first, over the optimizers' parameters outside the blocks (their
    ``.grad`` in memory). Then the blocks' gradients kept in memory (a pinned block's, or after a failed write) are
    unscaled in place, and those on storage are read, unscaled and written back, one block at a time.

    Args:
        training: The offload's training mode.
        blocks: Its blocks.
        optimizers: Its optimizers (their parameters outside ``blocks`` are unscaled by ``unscale_groups``).
        unscale_groups: The scaler's pass over the optimizer's ``param_groups``.
        inv_scale: The scaler's inverse scale.
        found_inf: The scaler's overflow flag.
        allow_fp16: Whether float16 gradients may be unscaled.

    Returns:
        The overflow flag per device that the scaler reads in ``step``/``update``.

    Raises:
        StreamedParameterError: In fused mode (its blocks stepped inside backward, before this).
    """
    if not isinstance(training, Grads):
        raise StreamedParameterError(
            f'GradScaler.unscale_ over offload_parameters(train=TrainOptions(mode="{training.name}")): the blocks '
            f"stepped inside backward, before the scaler could unscale their gradients or skip an overflow. Use "
            f'offload_parameters(..., train=TrainOptions(optimizer, mode="grads")): its step() comes after the '
            f"whole backward, so scaler.step() unscales, checks and skips exactly as in memory"
        )
    training.unscaled = True  # a backward before step()/zero_grad() is refused (Grads.before_backward)
    for block in blocks:
        block.unguard_grads()  # as step() does: blocks in memory with their gradients away read None, plainly
    try:
        todo = training.blocks_with_grads()
        masters = {id(m) for block in blocks for m in block.masters}
        outside = [
            [p for p in group["params"] if id(p) not in masters]
            for optimizer in optimizers
            for group in optimizer.param_groups
        ]
        per_device = unscale_groups(SimpleNamespace(param_groups=[{"params": params} for params in outside]))
        unscale_(
            [grad for block in todo for grad in block.grads.values()], inv_scale, found_inf, per_device, allow_fp16
        )
        _unscale_stored(
            training,
            [b for b in todo if training.store.has_stored_grads(b)],
            inv_scale,
            found_inf,
            per_device,
            allow_fp16,
        )
    finally:
        for block in blocks:
            block.guard_grads()
    return per_device


def _unscale_stored(
    training: Grads,
    stored: list[Block],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_device: dict[torch.device, torch.Tensor],
    allow_fp16: bool,
) -> None:
    """Read each block's stored gradients (``prefetch`` ahead), unscale them in the staging buffer, write them back."""
    store, reads = training.store, {}

    def start(k: int) -> None:
        if k < len(stored):
            reads[k] = store.read_grads(stored[k])

    try:
        for k in range(training.prefetch + 1):
            start(k)
        for k, block in enumerate(stored):
            read = reads.pop(k)
            try:
                grads = store.timed_wait(read)[block.grad_group]
                unscale_(grads.values(), inv_scale, found_inf, per_device, allow_fp16)
                store.write_grads(block, grads).wait()  # before the staging buffer goes back to the pool
            finally:
                read.release()
            start(k + 1 + training.prefetch)
    finally:
        for read in reads.values():
            read.release()
