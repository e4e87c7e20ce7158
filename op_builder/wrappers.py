"""What a package built on the op builders makes ``load()`` return: a wrapper per op around its native module
(deepoffload registers its DeepSpeed-shaped module for ``async_io``). ``load_native()`` never applies it."""

from __future__ import annotations

from typing import Any, Callable

_module_wrappers: dict[str, Callable[[Any], Any]] = {}


def register_module_wrapper(op: str, wrapper: Callable[[Any], Any]) -> None:
    """Make ``load()`` of op ``op`` return ``wrapper(native_module)`` (the last registration wins)."""
    _module_wrappers[op] = wrapper


def module_wrapper(op: str) -> Callable[[Any], Any] | None:
    """The wrapper registered for ``op``, or None."""
    return _module_wrappers.get(op)
