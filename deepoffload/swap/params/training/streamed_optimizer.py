"""Training loops that own the optimizer calls (Hugging Face ``transformers.Trainer`` among them).

``StreamedOptimizer(offload)`` is an optimizer-shaped view of a ``ParameterOffload``: ``step()`` is ``offload.step()``,
``zero_grad()`` is ``offload.zero_grad()``, and ``param_groups`` are the live groups of its optimizers, so learning-rate
schedulers drive the streamed blocks too. ``StreamedOptimizer.load_state_dict`` also takes the state of an optimizer
that ran in memory and named its parameters (``from_memory``), so a Trainer checkpoint of an in-memory run resumes
streamed. The ``Trainer``'s arguments are ``deepoffload.trainer_arguments``
(``deepoffload/integrations/hugging_face/trainer.py``), whose callback gives the scheduler one entry per streamed group.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch

from ....errors import CheckpointError
from ..blocks.placeholders import internal_call
from ..offload import ParameterOffload
from .scaling import unscale_blocks


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
            raise ValueError(
                "StreamedOptimizer: offload_parameters() got no train=TrainOptions(optimizer); pass one to train"
            )
        if clip_grad_norm is not None and offload.mode != "grads":
            raise ValueError(
                "StreamedOptimizer(clip_grad_norm=...): clipping needs offload_parameters(..., "
                'train=TrainOptions(optimizer, mode="grads"))'
            )
        # not Optimizer.__init__: the parameters and their state belong to offload's optimizers
        self.offload, self.clip_grad_norm = offload, clip_grad_norm
        self._sources: list[int | None] | None = None  # the in-memory group of each group, after loading such a state
        self._memory_groups = 0
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

    def deepoffload_unscale_(
        self,
        unscale_groups: Callable[[Any], dict[torch.device, torch.Tensor]],
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale and check every gradient for a ``GradScaler``, the streamed blocks' too (``training.scaling``).

        ``scaler.unscale_(self)`` and ``scaler.step(self)`` call it in place of their pass over ``param_groups``.

        Args:
            unscale_groups: The scaler's own pass, over the ``param_groups`` of what it is given; returns the
                overflow flag per device.
            inv_scale: The scaler's inverse scale.
            found_inf: The scaler's overflow flag.
            allow_fp16: Whether float16 gradients may be unscaled.

        Returns:
            The overflow flag per device, which the scaler reads in ``step``/``update``.
        """
        off = self.offload
        return unscale_blocks(
            off.training, off.blocks, off.optimizers, unscale_groups, inv_scale, found_inf, allow_fp16
        )

    @internal_call
    def state_dict(self) -> dict[str, Any]:
        """The state dicts of ``offload``'s optimizers, under ``"optimizers"`` (the offloaded state read back)."""
        return {"optimizers": [optimizer.state_dict() for optimizer in self.offload.optimizers]}

    @internal_call
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load each of ``offload``'s optimizers from a ``state_dict()`` of this class.

        Also loads the ``state_dict()`` of an optimizer that ran in memory (``optimizer.pt`` of a ``Trainer``
        checkpoint) when it names its parameters (built over ``model.named_parameters()``): each streamed parameter
        gets the state and group settings its name had there, as loading in memory would give them.

        Args:
            state_dict: What ``state_dict()`` returned for the same ``offload_parameters()`` setup, or a named
                in-memory optimizer's state dict.

        Raises:
            ValueError: When ``state_dict`` does not hold one state per optimizer.
            CheckpointError: (a ValueError) When an in-memory optimizer's state dict cannot be loaded exactly: its
                parameters are not named, a streamed parameter has no entry, state belongs to a parameter no
                streamed optimizer steps, or one streamed group would need several settings.
        """
        states: Any
        if "optimizers" not in state_dict and "param_groups" in state_dict:
            states, self._sources = from_memory(self.offload, state_dict)
            self._memory_groups = len(state_dict["param_groups"])
        else:
            states = state_dict.get("optimizers")
        if not isinstance(states, list) or len(states) != len(self.offload.optimizers):
            raise ValueError(
                "StreamedOptimizer.load_state_dict: expected the state_dict() of a StreamedOptimizer "
                "over the same offload_parameters() setup"
            )
        for optimizer, state in zip(self.offload.optimizers, states):
            optimizer.load_state_dict(state)

    def adapt_scheduler(self, scheduler: Any) -> None:
        """Give a learning-rate scheduler loaded from an in-memory run's checkpoint one entry per streamed group.

        After ``load_state_dict`` of an in-memory optimizer's state, the scheduler's state from the same checkpoint
        has one ``base_lrs`` (``_last_lr``, ``max_lrs``, ``min_lrs``) entry per in-memory group; each streamed group
        gets the entry of the group it took its settings from. ``trainer_arguments``' callback calls it when the
        ``Trainer`` resumes; call it after ``scheduler.load_state_dict`` in a loop of your own. Otherwise a no-op.

        Args:
            scheduler: A ``torch.optim.lr_scheduler`` scheduler over this optimizer.

        Raises:
            CheckpointError: When the streamed groups take their entries in another order than the in-memory ones
                had, with as many groups on both sides (which entries were loaded cannot be told).
        """
        sources, count = self._sources, len(self.param_groups)
        if sources is None or sources == list(range(count)):
            return
        for attribute in ("base_lrs", "_last_lr", "max_lrs", "min_lrs"):
            values = getattr(scheduler, attribute, None)
            if not isinstance(values, list) or len(values) != self._memory_groups:
                continue
            mapped = [values[s] if s is not None else values[0] for s in sources]
            if count == self._memory_groups and mapped != values:
                raise CheckpointError(
                    f"StreamedOptimizer.adapt_scheduler: the streamed optimizers' {count} groups take their settings "
                    f"from the in-memory groups {sources}: make the optimizer factory of offload_parameters() group "
                    f"the parameters as the in-memory optimizer did"
                )
            setattr(scheduler, attribute, mapped)

    def __repr__(self) -> str:
        return f"StreamedOptimizer({', '.join(type(o).__name__ for o in self.offload.optimizers)})"


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key not in ("params", "param_names")}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) and isinstance(b[k], torch.Tensor) else a[k] == b[k]
        for k in a
    )


def from_memory(offload: ParameterOffload, state_dict: dict[str, Any]) -> tuple[list[dict[str, Any]], list[int | None]]:
    """One state dict per optimizer of ``offload`` from a named in-memory optimizer's ``state_dict``.

    Args:
        offload: The streamed model's offload.
        state_dict: ``state`` and ``param_groups`` of a torch optimizer; each group must carry ``param_names``.

    Returns:
        The state dicts, in the order of ``offload.optimizers``, and for each of their groups (in the order of
        ``StreamedOptimizer.param_groups``) the in-memory group whose settings it took (None: an empty group).

    Raises:
        CheckpointError: When it cannot be loaded exactly (see ``StreamedOptimizer.load_state_dict``).
    """
    groups, state = state_dict["param_groups"], state_dict.get("state", {})
    if not all("param_names" in group for group in groups):
        raise CheckpointError(
            "StreamedOptimizer.load_state_dict: this is the state_dict() of an optimizer that ran in memory (e.g. "
            "optimizer.pt of a Trainer checkpoint of an in-memory run) and it does not name its parameters, so "
            "which streamed parameter each state belongs to is unknown. What works: build the in-memory optimizer "
            "over named parameters (torch.optim.AdamW(model.named_parameters(), ...) names them in its "
            "state_dict(), which loads here, also through Trainer(resume_from_checkpoint=...)); or name them in the "
            "saved dict (state['param_groups'][i]['param_names'] = the names of group i's parameters, in order); "
            "or resume from a checkpoint of a streamed run"
        )
    where = {
        name: (g, key) for g, group in enumerate(groups) for name, key in zip(group["param_names"], group["params"])
    }
    names = {id(m): block.qualified(n) for block in offload.blocks for n, m in zip(block.names, block.masters)}
    names.update((id(p), n) for n, p in offload.rest_named)
    used: set[str] = set()
    result = []
    sources: list[int | None] = []
    for optimizer in offload.optimizers:
        loaded: dict[int, Any] = {}
        loaded_groups: list[dict[str, Any]] = []
        for group in optimizer.param_groups:
            settings = _settings(group)  # (an empty group keeps its own)
            source = None
            indices = []
            for k, param in enumerate(group["params"]):
                name = names[id(param)]
                if name not in where:
                    raise CheckpointError(
                        f"StreamedOptimizer.load_state_dict: the in-memory optimizer's state_dict has no parameter "
                        f"named {name}, which the streamed optimizers step (was it built over the same model?)"
                    )
                g, key = where[name]
                if k == 0:
                    settings, source = _settings(groups[g]), g
                elif not _same(settings, _settings(groups[g])):
                    raise CheckpointError(
                        f"StreamedOptimizer.load_state_dict: in memory, {name} was in a group with other settings "
                        f"({_settings(groups[g])}) than parameters the streamed optimizer holds in one group with "
                        f"it ({settings}): make the optimizer factory of offload_parameters() group them as the "
                        f"in-memory optimizer did"
                    )
                used.add(name)
                index = sum(len(done["params"]) for done in loaded_groups) + k
                if key in state:
                    loaded[index] = state[key]
                indices.append(index)
            loaded_groups.append({**settings, "params": indices})
            sources.append(source)
        result.append({"state": loaded, "param_groups": loaded_groups})
    stray = sorted(name for name, (_, key) in where.items() if name not in used and key in state)
    if stray:
        raise CheckpointError(
            f"StreamedOptimizer.load_state_dict: the in-memory optimizer's state_dict holds state of "
            f"{', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}, which no streamed optimizer steps (frozen "
            f"now, or another model?)"
        )
    return result, sources
