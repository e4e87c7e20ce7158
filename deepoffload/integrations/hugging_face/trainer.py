"""``trainer_arguments(offload)``: the ``optimizers=`` and ``callbacks=`` that stream a model's blocks in ``Trainer``.

The callback refuses ``max_grad_norm > 0``, since the Trainer would clip only the parameters in memory (clip with
``trainer_arguments(offload, clip_grad_norm=...)`` in grads mode instead), refuses gradient accumulation in fused
mode, and lets the streamed parameters' ``.grad`` read None during training, so the gradient norm the Trainer logs
covers the parameters in memory only. The optimizer is a ``StreamedOptimizer``
(``deepoffload/swap/params/training/streamed_optimizer.py``). transformers is imported only when it runs.
"""

from __future__ import annotations

from typing import Any

from ...swap.params.offload import ParameterOffload
from ...swap.params.training.streamed_optimizer import StreamedOptimizer


def trainer_arguments(offload: ParameterOffload, clip_grad_norm: float | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.Trainer`` that stream ``offload``'s blocks.

    Use as ``Trainer(model, args, ..., **trainer_arguments(offload))``.

    Args:
        offload: The ``ParameterOffload`` of the model trained.
        clip_grad_norm: Grads mode only: clip by the global norm (see ``StreamedOptimizer``).

    Returns:
        ``optimizers=`` (a ``StreamedOptimizer``, the Trainer's default scheduler) and ``callbacks=`` (checks the
        arguments at the start of training: ``max_grad_norm`` must be 0, and gradient accumulation needs grads mode).

    Examples:
        >>> import torch, deepoffload
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> sgd = deepoffload.TrainOptions(lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> off = deepoffload.offload_parameters(model, "swap", train=sgd)
        >>> arguments = deepoffload.trainer_arguments(off)  # Trainer(model, args, ..., **arguments)
        >>> sorted(arguments), type(arguments["optimizers"][0]).__name__
        (['callbacks', 'optimizers'], 'StreamedOptimizer')
        >>> off.close()
    """
    from transformers import TrainerCallback

    class StreamingCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if args.max_grad_norm and args.max_grad_norm > 0:
                raise ValueError(
                    f"Trainer max_grad_norm={args.max_grad_norm} with streamed blocks: the Trainer "
                    f"would clip only the gradients in memory, not the streamed blocks'. Set "
                    f'TrainingArguments(max_grad_norm=0) and, to clip, use mode="grads" and '
                    f"trainer_arguments(offload, clip_grad_norm=...)"
                )
            if args.gradient_accumulation_steps > 1 and offload.mode == "fused":
                raise ValueError(
                    "Trainer gradient_accumulation_steps > 1 needs offload_parameters(..., "
                    'train=TrainOptions(optimizer, mode="grads")): in fused mode each block steps inside its backward'
                )
            # the Trainer logs a gradient norm over model.parameters() before each step: the streamed blocks'
            # gradients read None there (that logged norm covers the parameters in memory only)
            for block in offload.blocks:
                block.grads_read_as_none = True
            if kwargs.get("lr_scheduler") is not None:  # loaded from an in-memory run's checkpoint: one entry per group
                optimizer.adapt_scheduler(kwargs["lr_scheduler"])

        def on_step_end(self, args, state, control, **kwargs):
            # the Trainer's model.zero_grad() reaches the gradients in memory only; those the blocks keep (on storage
            # in grads mode) are dropped here, as it drops them in memory. step() already consumed them, except
            # after a step a GradScaler skipped, where they would be added to the next step's.
            offload.zero_grad()

        def on_train_end(self, args, state, control, **kwargs):
            for block in offload.blocks:
                block.grads_read_as_none = False

    optimizer = StreamedOptimizer(offload, clip_grad_norm)
    return {"optimizers": (optimizer, None), "callbacks": [StreamingCallback()]}
