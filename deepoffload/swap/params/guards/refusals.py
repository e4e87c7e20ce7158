"""What a ``ParameterOffload`` refuses, each with a message that says what to do instead.

A budget that is not a number of bytes, a parameter shared between two blocks or between a block and the rest of the
module (checked when offloading), and a block's backward that cannot train it: through a forward made before its last
optimizer step, of parameters served read-only from the checkpoint, of a parameter frozen when the optimizers were made
and unfrozen since (no optimizer holds it), or of parameters needing gradients without ``optimizer=``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ....errors import StreamedParameterError
from ...scaled_losses import unscales_own_grads
from ..autograd.recompute import BlockCall
from ..blocks.residency import Block

if TYPE_CHECKING:
    from ..training.optimizers import Optimizers


def check_budget(budget: object) -> None:
    """Refuse a ``max_resident_bytes`` that is not None or a number of bytes, 0 or more."""
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise ValueError(f"max_resident_bytes={budget!r}: expected a number of bytes, 0 or more")


def check_sharing(module: nn.Module, blocks: list[Block]) -> None:
    """Refuse a parameter shared between two blocks, or between a block and the rest of the module."""
    owner: dict[int, str] = {}
    for block in blocks:
        for name, param in zip(block.names, block.params):
            other = owner.setdefault(id(param), block.qualified(name))
            if other != block.qualified(name):
                raise ValueError(
                    f"parameter {block.qualified(name)} is the same tensor as {other} in another "
                    f"block: shared parameters must stay in memory; choose blocks= without them"
                )
    # a block may sit at several places (one module twice in a Sequential): each place is that block, called again
    modules = {id(b.module) for b in blocks}
    prefixes = tuple(name + "." for name, sub in module.named_modules(remove_duplicate=False) if id(sub) in modules)
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in owner and not name.startswith(prefixes):
            raise ValueError(
                f"parameter {name} (outside the blocks) is the same tensor as {owner[id(param)]} "
                f"in a block: shared parameters must stay in memory; choose blocks= without it"
            )


def check_backward(call: BlockCall, optimizers: Optimizers) -> None:
    """Refuse the backward of ``call`` when it cannot train its block (see ``ParameterOffload.before_backward``)."""
    block = call.block
    if call.steps != block.steps:
        raise StreamedParameterError(
            f"block {block.prefix}: backward through a forward made before the block's last "
            f"optimizer step (its weights changed since; in memory PyTorch would refuse too). "
            f"Run validation under torch.no_grad(), and backward each forward before step()"
        )
    read_only = block.source.read_only()
    if block.trainable and read_only is not None:
        raise StreamedParameterError(
            f"block {block.prefix}: backward would train parameters that are {read_only}, which is never "
            f"written: offload without serve_from_checkpoint= to train, or freeze them "
            f"(requires_grad_(False))"
        )
    optimizers.check_unfrozen(block)
    if block.trainable and optimizers.block is None:
        raise StreamedParameterError(
            f"block {block.prefix}: backward needs gradients of its parameters but "
            f"offload_parameters() got no optimizer: pass train=TrainOptions(optimizer) to train, or freeze the "
            f"parameters (requires_grad_(False))"
        )


def scaled_loss_error(mode: str, scaler: Any) -> StreamedParameterError | None:
    """The refusal of a ``GradScaler``'s scaled loss over a training offload, or None where that is exact.

    Asked by ``scaled_losses`` at ``scale()``: None where the scaler sees every gradient before any block steps.

    Fused mode steps each block inside backward, before ``scaler.unscale_``/``scaler.step`` can unscale its
    gradients or skip an overflowing step. Grads mode keeps them until ``step()``, and ``scaler.step`` on a
    ``StreamedOptimizer`` unscales and checks them where they are (``training.scaling``), unless the scaler's class
    unscales with its own ``_unscale_grads_`` (torch's ``ShardedGradScaler``), which cannot reach them.

    Args:
        mode: The ``ParameterOffload``'s mode ("fused" or "grads"), which trains blocks.
        scaler: The ``GradScaler`` scaling the loss (None: unknown).

    Returns:
        The error naming what works, or None.
    """
    if mode == "grads" and scaler is not None and unscales_own_grads(scaler):
        return None
    if mode == "grads":
        return StreamedParameterError(
            f"offload_parameters(train=TrainOptions(mode='grads')): this {type(scaler).__name__} unscales "
            f"gradients with its own _unscale_grads_, which cannot reach the streamed blocks' gradients on storage, "
            f"so they would step scaled and an overflow would not be skipped; nothing was stepped. Use "
            f"torch.amp.GradScaler with scaler.step(StreamedOptimizer(off)), which unscales them exactly as in memory"
        )
    return StreamedParameterError(
        f"offload_parameters(train=TrainOptions(mode={mode!r})): a GradScaler scales this loss, but {mode} mode "
        f"steps each block inside backward, before scaler.unscale_()/scaler.step() can unscale its gradients or "
        f"skip an overflowing step; nothing was stepped. Use offload_parameters(..., train=TrainOptions(optimizer, "
        f'mode="grads")) and scaler.step(StreamedOptimizer(off)): the blocks then step after the whole backward and '
        f"the scaler unscales, checks and skips exactly as in memory (bfloat16 needs no GradScaler at all)"
    )
