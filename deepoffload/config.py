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
from .op_builder.async_io import ENGINE_NAMES

ENGINES = ("auto", *ENGINE_NAMES)
ALIASES = {"thread_count": "intra_op_parallelism"}
ENV_PREFIX = env.AIO_PREFIX


UNITS = {
    "block_size": "bytes per IO request",
    "queue_depth": "requests in flight per thread",
    "intra_op_parallelism": "threads sharing one transfer",
    "buffer_count": "staging buffers",
    "chunk_bytes": "bytes of state per chunk",
}


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: must be a positive integer ({UNITS.get(key, 'a count')}), got {value!r}")
    return value


def _bool(key: str, value: Any) -> bool:
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

    block_size: bytes per IO request (the op splits each transfer into blocks of this size).
    queue_depth: requests kept in flight per thread.
    intra_op_parallelism: threads that share one transfer (each gets a contiguous part).
    single_submit: submit one request per system call instead of batches.
    overlap_events: refill the queue as completions arrive instead of waiting for a whole batch.
    engine: "auto" (the best engine whose self-test passes) or one of ``ENGINES`` (io_uring, libaio, posix, windows).
    """

    block_size: int = 1 << 20
    queue_depth: int = 32
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    engine: str = "auto"

    def __post_init__(self) -> None:
        for key in ("block_size", "queue_depth", "intra_op_parallelism"):
            _positive_int(key, getattr(self, key))
        for key in ("single_submit", "overlap_events"):
            _bool(key, getattr(self, key))
        if self.engine not in ENGINES:
            raise ConfigError(f"engine: expected one of {', '.join(ENGINES)}, got {self.engine!r}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, base: "AioConfig | None" = None) -> "AioConfig":
        """Build from a dict of DeepSpeed ``aio`` keys (and ``engine``); unknown keys are errors."""
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
        """Read a JSON file: either the ``aio`` section itself or a document with an ``aio`` key."""
        data = read_json(path)
        if isinstance(data, dict) and isinstance(data.get("aio"), dict):
            data = data["aio"]
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "AioConfig":
        """Defaults, overridden by ``DEEPOFFLOAD_AIO_<KEY>`` variables (e.g. ``DEEPOFFLOAD_AIO_ENGINE=posix``; the
        alias ``DEEPOFFLOAD_AIO_THREAD_COUNT`` too). Any other ``DEEPOFFLOAD_AIO_*`` variable is a ``ConfigError``.
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
        return dataclasses.asdict(self)
