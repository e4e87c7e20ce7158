"""Async-IO settings: one set of defaults, defined here, overridable by environment variables and config files.

Keys match DeepSpeed's ``aio`` section (``block_size``, ``queue_depth``, ``intra_op_parallelism``, ``single_submit``,
``overlap_events``; ``thread_count`` is accepted as an alias) so existing configs work, plus ``engine``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError
from .op_builder import env

ALIASES = {"thread_count": "intra_op_parallelism"}
ENV_PREFIX = env.AIO_PREFIX


UNITS = {
    "block_size": "bytes per IO request",
    "queue_depth": "requests in flight per thread",
    "intra_op_parallelism": "threads sharing one transfer",
    "buffer_count": "staging buffers",
    "chunk_bytes": "bytes of state per chunk",
}


def positive_int(key: str, value: Any) -> int:
    """``value`` when it is a positive integer (not a bool).

    Args:
        key: The setting's name, for the message.
        value: What was given.

    Returns:
        ``value``.

    Raises:
        ConfigError: When it is not, naming ``key`` and its unit.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: must be a positive integer ({UNITS.get(key, 'a count')}), got {value!r}")
    return value


def check_bool(key: str, value: Any) -> bool:
    """``value`` when it is a bool.

    Args:
        key: The setting's name, for the message.
        value: What was given.

    Returns:
        ``value``.

    Raises:
        ConfigError: When it is not, naming ``key``.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def read_json(path: str | os.PathLike) -> Any:
    """The JSON document in ``path``; ``ConfigError`` naming the file when it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from e
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e


@dataclass(frozen=True)
class AioConfig:
    """How the async-IO op moves bytes.

    Frozen: ``dataclasses.replace`` (or ``from_dict(..., base=...)``) makes a changed copy. Every value is checked
    when the config is made; a bad one raises ``ConfigError`` (a ``ValueError``) naming the key.

    Attributes:
        block_size: bytes per IO request (the op splits each transfer into blocks of this size).
        queue_depth: requests kept in flight per thread.
        intra_op_parallelism: threads that share one transfer (each gets a contiguous part).
        single_submit: submit one request per system call instead of batches.
        overlap_events: refill the queue as completions arrive instead of waiting for a whole batch.
        engine: "auto" (the first registered engine usable here) or a registered engine's name (the built-in
            ones: io_uring, libaio, posix, windows; see ``deepoffload.io.engines``). Engines can be registered after
            the config is made: the name is looked up when a handle opens (``ConfigError`` listing the registered
            engines when none has it; ``SwapConfig`` checks it when it is made).

    Examples:
        >>> import deepoffload
        >>> config = deepoffload.AioConfig(queue_depth=8)
        >>> config.queue_depth, config.block_size
        (8, 1048576)
        >>> deepoffload.AioConfig.from_dict({"thread_count": 2}, base=config).intra_op_parallelism
        2
        >>> config.to_dict()["engine"]
        'auto'
    """

    block_size: int = 1 << 20
    queue_depth: int = 32
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    engine: str = "auto"

    def __post_init__(self) -> None:
        for key in ("block_size", "queue_depth", "intra_op_parallelism"):
            positive_int(key, getattr(self, key))
        for key in ("single_submit", "overlap_events"):
            check_bool(key, getattr(self, key))
        if not isinstance(self.engine, str) or not self.engine:  # the name is looked up when a handle opens
            raise ConfigError(f"engine: expected 'auto' or an engine's name, got {self.engine!r}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The config's keys (its field names, without aliases), in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, base: "AioConfig | None" = None) -> "AioConfig":
        """Build from a dict of DeepSpeed ``aio`` keys (and ``engine``); unknown keys are errors.

        Args:
            values: Keys to values; ``thread_count`` is accepted as an alias of ``intra_op_parallelism``.
            base: The config whose other values are kept (default: ``AioConfig.from_env()``).

        Returns:
            A new config.

        Raises:
            ConfigError: When ``values`` is not a mapping, a key is unknown or given twice (as itself and its alias),
                or a value is not accepted.
        """
        if not isinstance(values, Mapping):
            raise ConfigError(f"aio config: expected a mapping of keys to values, got {type(values).__name__}")
        known = cls.keys()
        changes: dict[str, Any] = {}
        for key, value in values.items():
            name = ALIASES.get(key, key)
            if name not in known:
                raise ConfigError(f"unknown aio config key {key!r}; accepted: {', '.join(known + tuple(ALIASES))}")
            if name in changes:
                raise ConfigError(f"{key}: given twice (as {name!r} and its alias)")
            changes[name] = value
        return dataclasses.replace(base or cls.from_env(), **changes)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "AioConfig":
        """Read a JSON file: either the ``aio`` section itself or a document with an ``aio`` key.

        Keys not given keep the values of ``AioConfig.from_env()``. ``ConfigError`` names the file when it cannot be
        read or parsed, and the key when one is not accepted.

        Args:
            path: The JSON file.

        Returns:
            A new config.
        """
        data = read_json(path)
        if isinstance(data, dict) and isinstance(data.get("aio"), dict):
            data = data["aio"]
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "AioConfig":
        """The defaults, overridden by ``DEEPOFFLOAD_AIO_<KEY>`` variables.

        For example ``DEEPOFFLOAD_AIO_ENGINE=posix``; the alias ``DEEPOFFLOAD_AIO_THREAD_COUNT`` is accepted too.

        Args:
            environ: The variables to read (default: ``os.environ``).

        Returns:
            A new config.

        Raises:
            ConfigError: When a ``DEEPOFFLOAD_AIO_*`` variable is not one of the keys, a key is given twice (as
                itself and its alias), or a value does not parse.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        names = {ENV_PREFIX + key.upper(): key for key in (*fields, *ALIASES)}
        changes: dict[str, Any] = {}
        for var, text in env.prefixed(ENV_PREFIX, environ).items():
            if var not in names:  # a typo would otherwise be ignored silently
                raise ConfigError(f"{var}: unknown environment variable; accepted: {', '.join(names)}")
            key = names[var]
            f = fields[ALIASES.get(key, key)]
            if f.name in changes:
                raise ConfigError(f"{var}: given twice (as {ENV_PREFIX + f.name.upper()} and its alias)")
            kind = {"int": "int", "bool": "flag"}.get(f.type if isinstance(f.type, str) else f.type.__name__, "text")
            try:
                changes[f.name] = env.parse(var, kind, text)
            except env.EnvError as e:
                raise ConfigError(str(e)) from None
        return cls(**changes)

    def to_dict(self) -> dict[str, Any]:
        """The config as a dict of its keys to their values (what ``from_dict`` takes back).

        Returns:
            A new dict.
        """
        return dataclasses.asdict(self)
