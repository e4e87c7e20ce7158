"""Data-parallel wrappers that cannot hold a streamed model, refused with what to use instead.

``DistributedDataParallel`` keeps every parameter's gradient in its own flat buckets and reduces them after the
backward, but a streamed block steps (fused mode) or writes its gradients away (grads mode) inside its backward,
before DDP's reduction: the ranks would step with their own gradients and drift apart silently.
``TrainOptions(optimizer, data_parallel=True)`` averages each block's gradients inside its backward instead (see
``data_parallel``). FSDP2's ``fully_shard`` replaces each parameter by a sharded ``DTensor`` that it gathers before
each forward; a streamed block's parameters are 0-element placeholders filled from storage just before the block
runs, which FSDP2's gathering cannot see.
"""

from __future__ import annotations

import sys
from types import FrameType

from torch import nn

from ...ddp import ddp_class, ddp_holding

DDP_ADVICE = (
    "streamed blocks step (fused mode) or write their gradients away (grads mode) inside their backward, "
    "before DistributedDataParallel would reduce them, so the ranks would drift apart: do not wrap the "
    "model in DistributedDataParallel; pass offload_parameters(model, ..., train=TrainOptions(optimizer, "
    "data_parallel=True)) (or a "
    "ProcessGroup), which averages each block's gradients across the ranks inside its backward, as DDP "
    "does"
)
FSDP_ADVICE = (
    "FSDP2 (fully_shard) gathers sharded parameters it owns before each forward, and streaming fills a "
    "block's parameters from storage just before it runs: the two cannot hold the same parameters. Use "
    "offload_parameters(model, ..., train=TrainOptions(optimizer, data_parallel=True)) (each rank streams the "
    "whole model from its own "
    "storage), FSDP2 with deepoffload's OffloadedOptimizer (optimizer state on storage, parameters sharded "
    "in memory), or DeepSpeed ZeRO-3 with offload_param on NVMe through "
    "deepoffload.integrations.deepspeed.enable()"
)

_DDP_FILE = ("torch", "nn", "parallel", "distributed.py")
_FSDP_DIR = ("torch", "distributed", "fsdp")


def _path_has(filename: str, parts: tuple[str, ...]) -> bool:
    pieces = filename.replace("\\", "/").split("/")
    n = len(parts)
    return any(tuple(pieces[i : i + n]) == parts for i in range(len(pieces) - n + 1))


def wrapper_in_stack() -> str | None:
    """The data-parallel wrapper whose code is running on this thread's stack; only called on an error path.

    Returns:
        "DistributedDataParallel" or "fully_shard", else None.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _path_has(filename, _DDP_FILE):
            return "DistributedDataParallel"
        if _path_has(filename, _FSDP_DIR):
            return "fully_shard"
        frame = frame.f_back
    return None


def wrapper_message(wrapper: str, where: str) -> str:
    """The error message refusing ``wrapper`` around a streamed model, with the advice that fits it.

    Args:
        wrapper: "DistributedDataParallel" or "fully_shard" (as ``wrapper_in_stack`` returns).
        where: What was refused, the message's start.

    Returns:
        The message.
    """
    advice = DDP_ADVICE if wrapper == "DistributedDataParallel" else FSDP_ADVICE
    return f"{where}: {wrapper} cannot wrap a model whose parameters offload_parameters() streams: {advice}"


def refuse_wrapped(module: nn.Module) -> None:
    """Raise ValueError when ``module`` is a DDP wrapper, is held by one, or has FSDP2-sharded parameters."""
    ddp = ddp_class()
    if ddp is not None and isinstance(module, ddp):
        raise ValueError(f"offload_parameters() got a DistributedDataParallel wrapper: {DDP_ADVICE}")
    if ddp_holding(module.parameters()) is not None:
        raise ValueError(f"offload_parameters(): this model is wrapped in DistributedDataParallel: {DDP_ADVICE}")
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none before it is imported
    if dtensor is not None:
        for name, param in module.named_parameters():
            if isinstance(param, dtensor):
                raise ValueError(
                    f"offload_parameters(): parameter {name} is sharded by FSDP2 (fully_shard): {FSDP_ADVICE}"
                )
