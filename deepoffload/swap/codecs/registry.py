"""The registry of byte codecs: each ``ByteCodec`` subclass registered under the name ``SwapConfig`` and records use.

Every list of codecs (the config's error message, the docs, the tests' parametrisation) is derived from here.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from ...errors import ConfigError
from .base import ByteCodec

_CODECS: dict[str, type[ByteCodec]] = {}
C = TypeVar("C", bound=type[ByteCodec])


def register_codec(name: str) -> Callable[[C], C]:
    """A class decorator registering a ``ByteCodec`` subclass as ``SwapConfig(codec=name)``.

    Args:
        name: The codec's name (a non-empty string not registered yet; records store it).

    Returns:
        The decorator (it returns the class unchanged, its ``name`` set).

    Raises:
        ValueError: When ``name`` is empty or already taken.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_codec: expected a non-empty name, got {name!r}")
    if name in _CODECS:
        raise ValueError(f"register_codec: a codec named {name!r} is registered already ({_CODECS[name]!r})")

    def register(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, ByteCodec)):
            raise TypeError(f"register_codec({name!r}): {cls!r} is not a ByteCodec subclass")
        cls.name = name
        _CODECS[name] = cls
        return cls

    return register


def unregister_codec(name: str) -> None:
    """Remove the codec ``name`` from the registry (a test's toy); unknown names are ignored.

    Args:
        name: The codec's name.
    """
    _CODECS.pop(name, None)


def codec_class(name: str) -> type[ByteCodec]:
    """The codec registered as ``name``.

    Args:
        name: ``SwapConfig.codec``, or the codec a record was written with.

    Returns:
        The ``ByteCodec`` subclass.

    Raises:
        ConfigError: When no codec has that name (the message lists those that do).
    """
    cls = _CODECS.get(name)
    if cls is None:
        raise ConfigError(f"codec: no byte codec named {name!r}; registered: {', '.join(codec_names())}")
    return cls


def codec_names() -> list[str]:
    """The names of the registered codecs, in registration order.

    Returns:
        The names.
    """
    return list(_CODECS)
