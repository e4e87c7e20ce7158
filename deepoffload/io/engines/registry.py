"""The registry of IO engines: every list of engines is read from it.

``AioConfig``'s choices, the command line's ``--engine``, the report, ``auto``'s order and the tests'
parametrisation all come from here.

An engine is anything with the ``Engine`` protocol's attributes and methods. The built-in ones wrap the engines of the
native op (``NativeEngine``); an engine written in Python (``PythonEngine``) registers the same way. To add one, write
one file that defines it and call ``register`` (the built-ins are registered in ``deepoffload.io.engines``).
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

from ...errors import ConfigError

AUTO = "auto"  # not an engine: the best registered engine whose self-test passes here

# The flags of ``Backend.submit``; the native op defines the same values (checked by the tests).
TRUNCATE = 1  # after a successful write the file ends where the write ends
FSYNC = 4  # make the written data durable before the transfer completes

# (errno or 0, operation, path, offset, detail, direct): what ``Backend.wait`` returns for a finished transfer.
# ``direct``: True when the transfer used O_DIRECT, False when the filesystem refused it and buffered IO was used
# (warned once per folder), None for an engine that never asks for O_DIRECT.
Result = tuple[int, str, str, int, str, "bool | None"]


class Backend(Protocol):
    """One open engine: the transfers of one ``AsyncIOHandle`` (the native op's ``Handle`` has these methods)."""

    def submit(self, write: bool, ptr: int, nbytes: int, path: bytes, fd: int, offset: int, flags: int) -> int:
        """Start a transfer of ``nbytes`` bytes at memory address ``ptr``; return its op id (never waits for IO)."""
        ...

    def wait(self, op_id: int, timeout_s: float) -> Result | None:
        """The transfer's ``Result`` once it has finished (then forgotten), or None after ``timeout_s`` seconds."""
        ...

    def done(self, op_id: int) -> bool:
        """Whether the transfer has finished (``ValueError`` for an op id it does not know)."""
        ...

    def close(self) -> None:
        """Finish every transfer in flight and release the engine's threads and descriptors."""
        ...


@runtime_checkable
class Engine(Protocol):
    """An IO engine as the registry knows it.

    Attributes:
        name: The name users pass as ``engine=`` (``AioConfig.engine``, ``--engine``).
        description: One line for the report: what the engine is and what it needs.
        native: True for an engine of the native op (its status needs the op built), False for one in Python.
    """

    name: str
    description: str
    native: bool

    def status(self) -> tuple[bool, str]:
        """(usable here, why not): whether the engine exists here and passes its self-test."""
        ...

    def open(
        self, *, block_size: int, queue_depth: int, single_submit: bool, overlap_events: bool, intra_op_parallelism: int
    ) -> Backend:
        """A new ``Backend`` with these settings (``AioConfig``'s keys)."""
        ...


_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def register(engine: Engine) -> Engine:
    """Add ``engine`` after the engines already registered (``auto`` tries them in this order).

    Args:
        engine: The engine; its ``name`` must be new.

    Returns:
        ``engine``.

    Raises:
        TypeError: When ``engine`` lacks the ``Engine`` protocol's attributes or methods.
        ValueError: When its name is ``"auto"``, empty, or already registered.
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"register: {engine!r} is not an Engine (name, description, native, status(), open())")
    if not isinstance(engine.name, str) or not engine.name or engine.name == AUTO:
        raise ValueError(
            f"register: an engine's name must be a non-empty string other than 'auto', got {engine.name!r}"
        )
    with _lock:
        if engine.name in _engines:
            raise ValueError(f"register: an engine named {engine.name!r} is registered already")
        _engines[engine.name] = engine
    return engine


def unregister(name: str) -> Engine:
    """Remove the engine named ``name`` (handles already open with it keep working).

    Args:
        name: A registered engine's name.

    Returns:
        The engine removed.

    Raises:
        KeyError: When no engine has that name.
    """
    with _lock:
        return _engines.pop(name)


def engines() -> tuple[Engine, ...]:
    """Every registered engine, in registration order (the built-ins first, best first)."""
    with _lock:
        return tuple(_engines.values())


def names() -> tuple[str, ...]:
    """The registered engines' names, in registration order."""
    return tuple(engine.name for engine in engines())


def choices() -> tuple[str, ...]:
    """What ``engine=`` accepts: ``"auto"``, then every registered engine's name."""
    return (AUTO, *names())


def get(name: str) -> Engine:
    """The engine named ``name``.

    Args:
        name: A registered engine's name (not ``"auto"``).

    Returns:
        The engine.

    Raises:
        ConfigError: When no engine has that name (a ``ValueError``; the message lists the choices).
    """
    with _lock:
        engine = _engines.get(name)
    if engine is None:
        raise ConfigError(f"engine: expected one of {', '.join(choices())}, got {name!r}")
    return engine


def check_choice(name: str) -> str:
    """``name`` when ``engine=`` accepts it (``"auto"`` or a registered engine's name).

    Args:
        name: The name to check.

    Returns:
        ``name``.

    Raises:
        ConfigError: When no engine has that name (a ``ValueError``; the message lists the choices).
    """
    if name != AUTO:
        get(name)
    return name


def engine_status() -> dict[str, tuple[bool, str]]:
    """Every registered engine's ``status()``, in registration order (loads, and may build, the native op)."""
    return {engine.name: engine.status() for engine in engines()}


def resolve_engine(requested: str) -> Engine:
    """The engine to use for ``requested``: itself (checked) or, for ``"auto"``, the first one usable here.

    Args:
        requested: ``"auto"`` or a registered engine's name.

    Returns:
        The engine.

    Raises:
        ConfigError: When no engine has that name.
        OSError: When the engine asked for (for ``"auto"``, every engine) is not usable here.
    """
    if requested == AUTO:
        failures = []
        for engine in engines():
            ok, reason = engine.status()
            if ok:
                return engine
            failures.append(f"{engine.name}: {reason}")
        raise OSError(f"no async-IO engine works here ({'; '.join(failures)})")
    engine = get(requested)
    ok, reason = engine.status()
    if not ok:
        raise OSError(
            f"engine {requested!r} is not usable here: {reason}; use engine='auto' (see `deepoffload report`)"
        )
    return engine
