"""The registry of storage layouts: each ``StorageLayout`` subclass registered under the name ``SwapConfig`` uses.

Every list of layouts (the config's error message, the docs, the tests' parametrisation) is derived from here.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from ...errors import ConfigError
from .base import StorageLayout

_LAYOUTS: dict[str, type[StorageLayout]] = {}
L = TypeVar("L", bound=type[StorageLayout])


def register_layout(name: str) -> Callable[[L], L]:
    """A class decorator registering a ``StorageLayout`` subclass as ``SwapConfig(layout=name)``.

    Args:
        name: The layout's name (a non-empty string not registered yet).

    Returns:
        The decorator (it returns the class unchanged, its ``name`` set).

    Raises:
        ValueError: When ``name`` is empty or already taken.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_layout: expected a non-empty name, got {name!r}")
    if name in _LAYOUTS:
        raise ValueError(f"register_layout: a layout named {name!r} is registered already ({_LAYOUTS[name]!r})")

    def register(cls: L) -> L:
        if not (isinstance(cls, type) and issubclass(cls, StorageLayout)):
            raise TypeError(f"register_layout({name!r}): {cls!r} is not a StorageLayout subclass")
        cls.name = name
        _LAYOUTS[name] = cls
        return cls

    return register


def unregister_layout(name: str) -> None:
    """Remove the layout ``name`` from the registry (a test's toy); unknown names are ignored.

    Args:
        name: The layout's name.
    """
    _LAYOUTS.pop(name, None)


def layout_class(name: str) -> type[StorageLayout]:
    """The layout registered as ``name``.

    Args:
        name: ``SwapConfig.layout``.

    Returns:
        The ``StorageLayout`` subclass.

    Raises:
        ConfigError: When no layout has that name (the message lists those that do).
    """
    cls = _LAYOUTS.get(name)
    if cls is None:
        raise ConfigError(f"layout: no storage layout named {name!r}; registered: {', '.join(layout_names())}")
    return cls


def layout_names() -> list[str]:
    """The names of the registered layouts, in registration order.

    Returns:
        The names.
    """
    return list(_LAYOUTS)
