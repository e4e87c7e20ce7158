"""The registry of byte codecs: each ``ByteCodec`` subclass registered under the name ``SwapConfig`` and records use.

Every list of codecs (the config's error message, the docs, the tests' parametrisation) is derived from here.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from ..class_registry import ClassRegistry
from .base import ByteCodec

C = TypeVar("C", bound=type[ByteCodec])
_REGISTRY: ClassRegistry = ClassRegistry(ByteCodec, "byte codec", "codec", "register_codec")


def register_codec(name: str) -> Callable[[C], C]:
    """A class decorator registering a ``ByteCodec`` subclass as ``SwapConfig(codec=name)``.

    Args:
        name: The codec's name (a non-empty string not registered yet; records store it).

    Returns:
        The decorator (it returns the class unchanged, its ``name`` set).

    Raises:
        ValueError: When ``name`` is empty or already taken.
    """
    return _REGISTRY.register(name)


def unregister_codec(name: str) -> None:
    """Remove the codec ``name`` from the registry (a test's toy); unknown names are ignored.

    Args:
        name: The codec's name.
    """
    _REGISTRY.unregister(name)


def codec_class(name: str) -> type[ByteCodec]:
    """The codec registered as ``name``.

    Args:
        name: ``SwapConfig.codec``, or the codec a record was written with.

    Returns:
        The ``ByteCodec`` subclass.

    Raises:
        ConfigError: When no codec has that name (the message lists those that do).
    """
    return _REGISTRY.get(name)


def codec_names() -> list[str]:
    """The names of the registered codecs, in registration order.

    Returns:
        The names.
    """
    return _REGISTRY.names()
