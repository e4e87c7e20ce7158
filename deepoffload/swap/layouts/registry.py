"""The registry of storage layouts: each ``StorageLayout`` subclass registered under the name ``SwapConfig`` uses.

Every list of layouts (the config's error message, the docs, the tests' parametrisation) is derived from here.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from ..class_registry import ClassRegistry
from .base import StorageLayout

L = TypeVar("L", bound=type[StorageLayout])
_REGISTRY: ClassRegistry = ClassRegistry(StorageLayout, "storage layout", "layout", "register_layout")


def register_layout(name: str) -> Callable[[L], L]:
    """A class decorator registering a ``StorageLayout`` subclass as ``SwapConfig(layout=name)``.

    Args:
        name: The layout's name (a non-empty string not registered yet).

    Returns:
        The decorator (it returns the class unchanged, its ``name`` set).

    Raises:
        ValueError: When ``name`` is empty or already taken.
    """
    return _REGISTRY.register(name)


def unregister_layout(name: str) -> None:
    """Remove the layout ``name`` from the registry (a test's toy); unknown names are ignored.

    Args:
        name: The layout's name.
    """
    _REGISTRY.unregister(name)


def layout_class(name: str) -> type[StorageLayout]:
    """The layout registered as ``name``.

    Args:
        name: ``SwapConfig.layout``.

    Returns:
        The ``StorageLayout`` subclass.

    Raises:
        ConfigError: When no layout has that name (the message lists those that do).
    """
    return _REGISTRY.get(name)


def layout_names() -> list[str]:
    """The names of the registered layouts, in registration order.

    Returns:
        The names.
    """
    return _REGISTRY.names()
