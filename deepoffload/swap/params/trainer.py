"""Training loops that own the optimizer calls, Hugging Face ``transformers.Trainer`` first among them.

``StreamedOptimizer(offload)`` is an optimizer-shaped view of a ``ParameterOffload``: ``step()`` is ``offload.step()``,
``zero_grad()`` is ``offload.zero_grad()``, and ``param_groups`` are the live groups of its optimizers, so learning-rate
schedulers drive the streamed blocks too. ``trainer_arguments(offload)`` gives the ``optimizers=`` and ``callbacks=`` to
pass to ``Trainer``; the callback refuses ``max_grad_norm > 0``, since the Trainer would clip only the parameters in
memory (clip with ``StreamedOptimizer(offload, clip_grad_norm=...)`` in grads mode instead), and lets the streamed
parameters' ``.grad`` read None during training (outside a Trainer that read is refused until ``step()``), so the
gradient norm the Trainer logs covers the parameters in memory only. transformers is imported only by
``trainer_arguments``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch

from .offload import ParameterOffload
from .placeholders import internal_call


class StreamedOptimizer(torch.optim.Optimizer):
    """``offload``'s step and zero_grad behind the ``torch.optim.Optimizer`` interface (see the module docstring).

    Args:
        offload: The ``ParameterOffload`` to drive; it must have an ``optimizer=``.
        clip_grad_norm: Grads mode only: each ``step()`` clips all gradients by their global norm first, exactly as
            ``torch.nn.utils.clip_grad_norm_(module.parameters(), clip_grad_norm)`` would, and returns that norm.

    Raises:
        ValueError: When ``offload`` has no optimizer, or ``clip_grad_norm`` is given outside grads mode.
    """

    def __init__(self, offload: ParameterOffload, clip_grad_norm: float | None = None):
        if not offload.optimizers:
            raise ValueError("StreamedOptimizer: offload_parameters() got no optimizer=; pass one to train")
        if clip_grad_norm is not None and offload.mode != "grads":
            raise ValueError(
                'StreamedOptimizer(clip_grad_norm=...): clipping needs offload_parameters(..., mode="grads")'
            )
        # not Optimizer.__init__: the parameters and their state belong to offload's optimizers
        self.offload, self.clip_grad_norm = offload, clip_grad_norm
        self.defaults = dict(offload.optimizers[0].defaults)
        self._optimizer_step_pre_hooks = OrderedDict()  # (the types Optimizer.__init__ gives them)
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The live parameter groups of ``offload``'s optimizers (blocks' first); change their entries in place."""
        return [group for optimizer in self.offload.optimizers for group in optimizer.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        raise AttributeError("StreamedOptimizer.param_groups: change the groups' entries (e.g. 'lr') in place")

    # a plain empty dict, not Optimizer's defaultdict: a lookup fails rather than making up an entry
    @property  # type: ignore[override]
    def state(self) -> dict:
        """An empty dict: the optimizers' state is offloaded (see ``state_dict()``)."""
        return {}  # offloaded; see state_dict()

    @state.setter
    def state(self, value) -> None:
        raise AttributeError("StreamedOptimizer.state is offloaded: use load_state_dict()")

    # returns offload.step()'s gradient norm (a tensor, or None), not a closure's loss: closures are refused
    def step(self, closure: Callable[[], Any] | None = None) -> torch.Tensor | None:  # type: ignore[override]
        """Run ``offload.step()``, clipping with ``clip_grad_norm`` when given.

        Args:
            closure: Not supported: must be None.

        Returns:
            The total gradient norm when clipping, else None.

        Raises:
            ValueError: When a ``closure`` is given.
        """
        if closure is not None:
            raise ValueError(
                "StreamedOptimizer.step(closure): closures are not supported (blocks step inside "
                "backward in fused mode)"
            )
        return self.offload.step(clip_grad_norm=self.clip_grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Run ``offload.zero_grad()``.

        Args:
            set_to_none: For the gradients outside blocks: set them to None rather than to zero.
        """
        self.offload.zero_grad(set_to_none)

    @internal_call
    def state_dict(self) -> dict[str, Any]:
        """The state dicts of ``offload``'s optimizers, under ``"optimizers"`` (the offloaded state read back)."""
        return {"optimizers": [optimizer.state_dict() for optimizer in self.offload.optimizers]}

    @internal_call
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load each of ``offload``'s optimizers from a ``state_dict()`` of this class.

        Args:
            state_dict: What ``state_dict()`` returned for the same ``offload_parameters()`` setup.

        Raises:
            ValueError: When ``state_dict`` does not hold one state per optimizer.
        """
        states = state_dict.get("optimizers")
        if not isinstance(states, list) or len(states) != len(self.offload.optimizers):
            raise ValueError(
                "StreamedOptimizer.load_state_dict: expected the state_dict() of a StreamedOptimizer "
                "over the same offload_parameters() setup"
            )
        for optimizer, state in zip(self.offload.optimizers, states):
            optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"StreamedOptimizer({', '.join(type(o).__name__ for o in self.offload.optimizers)})"


def trainer_arguments(offload: ParameterOffload, clip_grad_norm: float | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.Trainer`` that stream ``offload``'s blocks.

    Use as ``Trainer(model, args, ..., **trainer_arguments(offload))``.

    Args:
        offload: The ``ParameterOffload`` of the model trained.
        clip_grad_norm: Grads mode only: clip by the global norm (see ``StreamedOptimizer``).

    Returns:
        ``optimizers=`` (a ``StreamedOptimizer``, the Trainer's default scheduler) and ``callbacks=`` (checks the
        arguments at the start of training: ``max_grad_norm`` must be 0, and gradient accumulation needs grads mode).
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
                    'mode="grads"): in fused mode each block steps inside its backward'
                )
            # the Trainer logs a gradient norm over model.parameters() before each step: the streamed blocks'
            # gradients read None there (that logged norm covers the parameters in memory only)
            for block in offload.blocks:
                block.grads_read_as_none = True

        def on_train_end(self, args, state, control, **kwargs):
            for block in offload.blocks:
                block.grads_read_as_none = False

    return {"optimizers": (StreamedOptimizer(offload, clip_grad_norm), None), "callbacks": [StreamingCallback()]}
