"""Loss scaling (``torch.amp.GradScaler``) where parameters step inside backward: refused before that backward.

A ``GradScaler`` multiplies the loss, so backward makes scaled gradients; it unscales them, and decides to skip a step
whose gradients overflowed, only in ``scaler.unscale_`` / ``scaler.step``, after backward. Whatever steps parameters
inside backward (``OffloadedOptimizer.step_in_backward()``, a training ``ParameterOffload``) would step them with the
scaled gradients, and could not skip an overflowing step. So ``GradScaler.scale`` is wrapped, once the first such
owner is registered with ``watch``, and so is the ``scale`` of every subclass that overrides it (torch's
``ShardedGradScaler``, one defined later): an enabled scaler first asks every live owner whose parameters the loss's
autograd graph reaches, and raises the error one returns, before the loss is even scaled. An owner the loss does not
reach (another model's optimizer, one dropped without ``close()`` that the cycle collector has not freed yet) is not
asked: its parameters step in no backward of this loss. With no owner alive it only costs an empty-set test; with one,
a walk of the loss's graph (once per ``scale()``).

``GradScaler._unscale_grads_`` (what ``unscale_`` and ``step`` use to unscale and find overflows) is wrapped too: an
optimizer with a ``deepoffload_unscale_`` method (``StreamedOptimizer``) runs the scaler's own pass over the
parameters whose ``.grad`` it holds and is given the same inverse scale and overflow flags, so gradients it keeps
elsewhere (a streamed model's, on storage in grads mode) are unscaled and checked exactly as torch checks those in
memory, before ``step`` decides to skip.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch


class LossGraph:
    """The leaf tensors a loss's backward reaches (its autograd graph, walked on first use).

    Args:
        outputs: What ``GradScaler.scale`` was given: a tensor or an iterable (nested) of tensors.
        scaler: The ``GradScaler`` scaling it (None when unknown).
    """

    def __init__(self, outputs: Any, scaler: Any = None):
        self._outputs = outputs
        self.scaler = scaler
        self._leaves: set[int] | None = None

    def reaches(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether backward from the loss accumulates a gradient into any of ``tensors`` (leaves)."""
        if self._leaves is None:
            self._leaves = _leaves(self._outputs)
        return any(id(t) in self._leaves for t in tensors)


def _leaves(outputs: Any) -> set[int]:
    """The ids of the leaf tensors whose ``AccumulateGrad`` nodes the graphs of ``outputs`` reach."""
    stack, seen, found = [], set(), set()
    pending = [outputs]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            if item.grad_fn is not None:
                stack.append(item.grad_fn)
            elif item.requires_grad:
                found.add(id(item))
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    while stack:  # the graph is a DAG whose node objects are unique: each is visited once
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it accumulates into
        if isinstance(variable, torch.Tensor):
            found.add(id(variable))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return found


class ScaledLossOwner(Protocol):
    """Something that steps parameters inside backward and must see no scaled loss."""

    def scaled_loss_error(self, graph: LossGraph) -> BaseException | None:
        """The error to raise for a scaled loss now, or None when this owner does not step in its backward.

        Args:
            graph: The loss's graph, to ask whether it reaches this owner's parameters.
        """


_owners: weakref.WeakSet = weakref.WeakSet()
_MARK = "_deepoffload_scaled_loss_check"


def watch(owner: ScaledLossOwner) -> None:
    """Ask ``owner`` before every enabled ``GradScaler.scale`` from now on, while it lives.

    Args:
        owner: Its ``scaled_loss_error()`` is called; the first error returned is raised.
    """
    _owners.add(owner)
    _install()


def unwatch(owner: ScaledLossOwner) -> None:
    """Stop asking ``owner`` (nothing happens when it was not watched).

    Args:
        owner: An owner given to ``watch``.
    """
    _owners.discard(owner)


def _install() -> None:
    """Wrap ``GradScaler.scale`` and every subclass's own ``scale`` (``ShardedGradScaler``), now and when defined."""
    base = torch.amp.GradScaler
    if getattr(base.__dict__["scale"], _MARK, False):
        return
    _wrap_unscale(base)
    classes = [base]
    while classes:
        cls = classes.pop()
        _wrap(cls)
        classes.extend(cls.__subclasses__())
    defined = base.__dict__.get("__init_subclass__")

    def init_subclass(cls: type, **kwargs: Any) -> None:
        if defined is not None:
            defined.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
        _wrap(cls)

    base.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment,method-assign]


def _wrap(cls: type) -> None:
    """Make ``cls``'s own ``scale`` (if it defines one) ask the owners first."""
    original = cls.__dict__.get("scale")
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        if _owners and getattr(self, "_enabled", True):
            graph = LossGraph(outputs, self)
            for owner in list(_owners):
                error = owner.scaled_loss_error(graph)
                if error is not None:
                    raise error
        return original(self, outputs)

    setattr(scale, _MARK, True)
    cls.scale = scale  # type: ignore[attr-defined]


def unscales_own_grads(scaler: Any) -> bool:
    """Whether ``scaler``'s class unscales through the wrapped ``GradScaler._unscale_grads_``.

    It then reaches ``deepoffload_unscale_``; an override of its own (torch's ``ShardedGradScaler``) does not.

    Args:
        scaler: A ``GradScaler``.

    Returns:
        True when its ``_unscale_grads_`` is the wrapped one of ``torch.amp.GradScaler``.
    """
    return getattr(type(scaler)._unscale_grads_, _MARK, False)


def _wrap_unscale(base: type) -> None:
    """Make ``base._unscale_grads_`` also unscale what an optimizer's ``deepoffload_unscale_`` holds."""
    original = base.__dict__["_unscale_grads_"]

    @functools.wraps(original)
    def _unscale_grads_(
        self: Any, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        hook = getattr(optimizer, "deepoffload_unscale_", None)
        if hook is None:
            return original(self, optimizer, inv_scale, found_inf, allow_fp16)
        return hook(
            lambda groups: original(self, groups, inv_scale, found_inf, allow_fp16), inv_scale, found_inf, allow_fp16
        )

    setattr(_unscale_grads_, _MARK, True)
    base._unscale_grads_ = _unscale_grads_  # type: ignore[attr-defined]


def unscale_(
    tensors: Iterable[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_device: dict[torch.device, torch.Tensor],
    allow_fp16: bool,
) -> None:
    """Unscale ``tensors`` in place and record any inf/NaN, as ``GradScaler._unscale_grads_`` does for ``.grad``.

    Args:
        tensors: The gradients (dense).
        inv_scale: The scaler's inverse scale.
        found_inf: The scaler's overflow flag (copied to each device that has none in ``per_device`` yet).
        per_device: The overflow flag of each device, which ``GradScaler.step``/``update`` read; completed here.
        allow_fp16: Whether float16 gradients may be unscaled (``GradScaler`` refuses them otherwise).

    Raises:
        ValueError: For a float16 gradient when ``allow_fp16`` is False (torch's own message).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        if not allow_fp16 and tensor.dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for (device, _), group in groups.items():
            if device not in per_device:
                per_device[device] = found_inf.to(device, copy=True)
            torch._amp_foreach_non_finite_check_and_unscale_(group, per_device[device], inv_scale.to(device))
