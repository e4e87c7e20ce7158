"""The training step of a ``ParameterOffload`` after backward, and the gradients and writes around it.

``step`` streams every block through its optimizer step in grads mode or waits for the blocks' write-backs in fused
mode (clipping by the global norm first when asked), then steps the parameters outside blocks; ``zero_grad`` clears
the gradients outside blocks and the blocks' stored ones; ``flush`` waits for every write and writes out blocks kept
in memory after a failed write. The ``ParameterOffload`` methods of these names are their entry points.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ... import grad_norm

if TYPE_CHECKING:
    from ..offload import ParameterOffload


def step(offload: ParameterOffload, clip_grad_norm: float | None, norm_type: float) -> torch.Tensor | None:
    """``ParameterOffload.step``: the total norm before clipping with ``clip_grad_norm``, else None."""
    offload._check_open()
    if offload._block_optimizer is None and offload._rest_optimizer is None:
        raise ValueError("step(): offload_parameters() got no optimizer=; pass one to train")
    if clip_grad_norm is not None:
        grad_norm.check_clip_args(clip_grad_norm, norm_type)
    for block in offload.blocks:
        offload.store.check_kept_values(block)  # a change a pinned block's masters cannot take raises before a step
    for block in offload.blocks:
        block.unguard_grads()  # blocks in memory step with plain parameters
    try:
        total, coefficient = offload.training.step(clip_grad_norm, norm_type)
        offload.training.end_step()
        offload.store.wait_writes()
    finally:
        offload._guard_grads()  # gradients a failure left away stay refused
    if offload._rest_optimizer is not None:
        if coefficient is not None:
            grad_norm.scale_([p.grad for p in offload.rest if p.grad is not None], coefficient)
        offload._rest_optimizer.step()
    return total


def zero_grad(offload: ParameterOffload, set_to_none: bool) -> None:
    """``ParameterOffload.zero_grad``: the gradients outside blocks and the blocks' gradients on storage."""
    offload._check_open()
    offload.training.finish_writes()
    if offload._rest_optimizer is not None:
        offload._rest_optimizer.zero_grad(set_to_none)
    offload.training.zero_grad()
    offload._guard_grads()


def flush(offload: ParameterOffload) -> None:
    """``ParameterOffload.flush``: every write waited for; the first failure raised once all were tried."""
    offload._check_open()
    error = None
    for action in (offload.training.finish_writes, offload.store.wait_writes):
        try:
            action()
        except OSError as e:
            error = error or e
    error = error or offload.store.flush_kept()
    if error is not None:
        raise error
