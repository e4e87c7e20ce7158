"""Finding a ``DistributedDataParallel`` that holds given parameters, for refusals that need the real reason.

DDP averages gradients only as backward ends, which streaming and ``step_in_backward`` cannot wait for.
"""

from __future__ import annotations

import gc
from typing import Iterable

import torch
from torch import nn

from ..errors import UnsupportedError


def ddp_class():
    """torch's DistributedDataParallel class, or None where torch.distributed is unavailable."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def ddp_holding(params: Iterable[torch.Tensor]) -> nn.Module | None:
    """A live ``DistributedDataParallel`` whose module holds one of ``params``, else None.

    It searches the objects the garbage collector tracks, so it is called once per setup, and only while
    torch.distributed is initialized (no DDP can exist otherwise).

    Args:
        params: The parameters to look for.

    Returns:
        The DDP module, or None when none holds any of them.
    """
    ddp = ddp_class()
    if ddp is None or not torch.distributed.is_initialized():
        return None
    ids = {id(p) for p in params}
    if not ids:
        return None
    for obj in gc.get_objects():
        if issubclass(type(obj), ddp):  # type(), not isinstance: no __class__ property runs
            if any(id(p) in ids for p in obj.module.parameters()):
                return obj
    return None


STEP_IN_BACKWARD_REASON = (
    "DistributedDataParallel averages gradients in buckets asynchronously and writes the averages into param.grad "
    "only when backward ends, so a chunk stepped inside backward would step with this rank's own, unaveraged "
    "gradients and the ranks would drift apart. Call step() after backward (DDP's gradients are averaged by then), "
    "or stream the model with offload_parameters(..., train=TrainOptions(optimizer, data_parallel=True)), which "
    "averages each block's gradients inside its backward"
)


def refuse_step_in_backward_under_ddp(params: Iterable[torch.Tensor]) -> None:
    """Refuse ``step_in_backward`` for parameters a ``DistributedDataParallel`` holds: it cannot wait for its averages.

    Args:
        params: The parameters to check.

    Raises:
        UnsupportedError: A RuntimeError, when a DistributedDataParallel holds one of ``params``.
    """
    if ddp_holding(params) is not None:
        raise UnsupportedError(
            f"OffloadedOptimizer.step_in_backward(): these parameters are in a "
            f"DistributedDataParallel model: {STEP_IN_BACKWARD_REASON}"
        )
