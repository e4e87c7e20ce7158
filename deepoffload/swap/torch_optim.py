"""What ``OffloadedOptimizer`` needs to know of a wrapped ``torch.optim`` optimizer.

Which ones cannot step in chunks, how to step one without its hooks, and torch's thread count while it steps.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import torch

UNSUPPORTED = (torch.optim.LBFGS,)
WRAPPED = "_deepoffload_wrapped"  # set on an optimizer once an OffloadedOptimizer has taken its state


def requires_closure(optimizer: torch.optim.Optimizer) -> bool:
    """True when the optimizer's ``step`` has a first argument without a default (it needs a closure)."""
    try:
        signature = inspect.signature(type(optimizer).step)  # follows torch's hook wrapper to the real step
    except (TypeError, ValueError):
        return False
    params = list(signature.parameters.values())[1:]  # after self
    first = params[0] if params else None
    return (
        first is not None
        and first.default is inspect.Parameter.empty
        and first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD)
    )


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """The optimizer's own ``step`` without torch's hook wrapper.

    That wrapper would run every global step hook once per chunk, with the wrapped optimizer as argument.

    Returns:
        The unwrapped ``step`` bound to ``optimizer`` (its ``step`` as it is when its class's is not hooked).
    """
    step: Any = type(optimizer).step  # (torch's hook wrapper carries ``hooked`` and ``__wrapped__``)
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        return functools.partial(step.__wrapped__, optimizer)
    return optimizer.step


def check_no_step_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a wrapped optimizer with step hooks of its own (they would not run).

    Args:
        optimizer: The wrapped optimizer.

    Raises:
        TypeError: When it has step pre- or post-hooks.
    """
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        raise TypeError(
            "OffloadedOptimizer: the wrapped optimizer has step hooks of its own, which would not run; "
            "register them on the OffloadedOptimizer (opt.register_step_pre_hook / "
            "register_step_post_hook) instead"
        )


@contextlib.contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside the block (None: left as it is), then restored."""
    previous = torch.get_num_threads()
    if count is None or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


PER_PARAMETER = "deepoffload_per_parameter"  # a class (or instance) attribute declaring how its step reads parameters


def _builtin_classes() -> set[type]:
    """torch's own optimizer classes (``torch.optim.Adam`` ...), whose steps read each parameter alone."""
    return {
        value
        for value in vars(torch.optim).values()
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
    }


def per_parameter(optimizer: torch.optim.Optimizer, declared: bool | None) -> bool | None:
    """Whether ``optimizer``'s step reads each parameter's gradient and state alone, so it can step in chunks.

    Args:
        optimizer: The wrapped optimizer.
        declared: What the user said (``OffloadedOptimizer(per_parameter=...)``); None: not said there.

    Returns:
        ``declared`` when given; else the optimizer's ``deepoffload_per_parameter`` attribute when it is a bool (a
        True declared by a class whose ``step`` a subclass replaced counts as unknown); else True for torch's
        built-in classes themselves (not subclasses, which may step otherwise); else None (unknown).
    """
    if declared is not None:
        return declared
    marked = getattr(optimizer, PER_PARAMETER, None)
    if marked is True and PER_PARAMETER not in vars(optimizer) and not _declared_with_step(type(optimizer)):
        return None  # declared by a class whose step a subclass replaced
    if isinstance(marked, bool):
        return marked
    return True if type(optimizer) in _builtin_classes() else None


def _declared_with_step(cls: type) -> bool:
    """Whether the class declaring ``deepoffload_per_parameter`` is (or derives from) the one defining ``step``."""
    # A subclass that replaces step (adding a global norm, say) is not covered by its base's declaration. torch's hook
    # wrapper (put on a class by its first instance) is looked through: the step's definer is the most basic class
    # whose step is, unwrapped, the function this class runs.
    declarer = next(c for c in cls.__mro__ if PER_PARAMETER in vars(c))
    step = inspect.unwrap(cls.step)  # type: ignore[attr-defined]
    definers = [c for c in cls.__mro__ if "step" in vars(c) and inspect.unwrap(vars(c)["step"]) is step]
    return issubclass(declarer, definers[-1]) if definers else False
