"""What a ``ParameterOffload`` refuses, each with a message that says what to do instead.

A budget that is not a number of bytes, a parameter shared between two blocks or between a block and the rest of the
module (checked when offloading), and a block's backward that cannot train it: through a forward made before its last
optimizer step, of parameters served read-only from the checkpoint, of a parameter frozen when the optimizers were made
and unfrozen since (no optimizer holds it), or of parameters needing gradients without ``optimizer=``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ...errors import StreamedParameterError
from .recompute import BlockCall
from .residency import Block

if TYPE_CHECKING:
    from ..optimizer import OffloadedOptimizer
    from .offload import ParameterOffload


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


def check_backward(offload: ParameterOffload, call: BlockCall) -> None:
    """Refuse the backward of ``call`` when it cannot train its block (see ``ParameterOffload.before_backward``)."""
    block = call.block
    if call.steps != block.steps:
        raise StreamedParameterError(
            f"block {block.prefix}: backward through a forward made before the block's last "
            f"optimizer step (its weights changed since; in memory PyTorch would refuse too). "
            f"Run validation under torch.no_grad(), and backward each forward before step()"
        )
    if block.trainable and block.served:
        raise StreamedParameterError(
            f"block {block.prefix}: backward would train parameters that are served read-only "
            f"from the checkpoint {block.served} (serve_from_checkpoint=True), which is never "
            f"written: offload without serve_from_checkpoint= to train, or freeze them "
            f"(requires_grad_(False))"
        )
    check_unfrozen(offload, block)
    if block.trainable and offload._block_optimizer is None:
        raise StreamedParameterError(
            f"block {block.prefix}: backward needs gradients of its parameters but "
            f"offload_parameters() got no optimizer: pass train=TrainOptions(optimizer) to train, or freeze the "
            f"parameters (requires_grad_(False))"
        )


def check_unfrozen(offload: ParameterOffload, block: Block) -> None:
    """Refuse a backward once a parameter frozen when the optimizers were made requires a gradient.

    No optimizer holds it, so it would never step (in memory, an optimizer made over ``model.parameters()``
    would step it).

    Raises:
        StreamedParameterError: When such a parameter requires a gradient (of ``block`` or outside the blocks).
    """
    if not offload._optimizing:
        return
    named = [(block.qualified(n), m) for n, p, m in zip(block.names, block.params, block.masters) if p.requires_grad]
    named += [(n, p) for n, p in offload._rest_named if p.requires_grad]
    for name, param in named:
        if id(param) not in offload._stepped_ids:
            offload._stepped_ids = optimized_ids(offload.optimizers)  # a param group added since?
        if id(param) not in offload._stepped_ids:
            raise StreamedParameterError(
                f"parameter {name} was frozen when offload_parameters() made the optimizers and "
                f"requires a gradient now (requires_grad_(True) after it), so no optimizer would "
                f"step it: unfreeze before offload_parameters() (freeze later instead: a frozen "
                f"parameter gets no gradient and is not stepped), or offload again"
            )


def optimized_ids(optimizers: list[OffloadedOptimizer]) -> set[int]:
    """The identities of the parameters ``optimizers`` step (those of their param groups)."""
    return {id(p) for o in optimizers for group in o.param_groups for p in group["params"]}


def scaled_loss_error(offload: ParameterOffload) -> StreamedParameterError | None:
    """The refusal of a ``GradScaler``'s scaled loss over ``offload`` (asked by ``scaled_losses`` at ``scale()``).

    The blocks' gradients never pass through ``scaler.unscale_``/``scaler.step``: fused mode steps each block inside
    backward, grads mode keeps them for ``step()`` where the scaler cannot reach them. The blocks would step on
    scaled gradients, and an overflowing step would not be skipped.

    Args:
        offload: A ``ParameterOffload`` made with ``optimizer=``.

    Returns:
        The error naming what works, or None when it is closed or trains no block.
    """
    if offload._closed or offload._block_optimizer is None:
        return None
    return StreamedParameterError(
        f"offload_parameters(mode={offload.mode!r}): a GradScaler scales this loss, but the streamed blocks' "
        f"gradients never reach scaler.unscale_()/scaler.step() (fused mode steps each block inside backward, "
        f"grads mode keeps them for off.step()), so the blocks would step on scaled gradients and an overflow "
        f"would not be skipped; nothing was stepped. bfloat16 needs no loss scaling: drop the GradScaler (with "
        f"compute_dtype=torch.bfloat16 or bf16 autocast, or in fp32), which trains exactly as the same loop in memory"
    )


def check_per_parameter(optimizers: list[OffloadedOptimizer]) -> None:
    """Refuse an optimizer declared to read several parameters in one step (``per_parameter=False``).

    A ``ParameterOffload`` steps each block, and the parameters outside the blocks, in steps of their own. The
    optimizers are closed first.

    Args:
        optimizers: The block and rest optimizers just made.

    Raises:
        StreamedParameterError: When one is not per-parameter.
    """
    whole = [opt for opt in optimizers if not opt.per_parameter]
    if whole:
        for opt in optimizers:
            opt.close()
        raise StreamedParameterError(
            f"offload_parameters(optimizer=...): this {type(whole[0].optimizer).__name__} is declared to read several "
            f"parameters in one step (deepoffload_per_parameter = False), but streamed blocks step block by block; "
            f"use an optimizer whose step reads each parameter alone (torch's built-in ones), or keep the model in "
            f"memory and put only its state on storage with OffloadedOptimizer(..., per_parameter=False)"
        )
