"""Swap settings: the async-IO settings (``AioConfig``, unchanged) plus where and how tensors are swapped.

A config dict or JSON file may hold the ``aio`` keys at top level (what ``deepoffload tune`` writes), under an
``aio`` section (DeepSpeed's layout), or both, next to the swap keys below. Unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import ALIASES as AIO_ALIASES
from ..config import AioConfig, ConfigError, check_bool, positive_int, read_json
from ..io.engines import check_choice
from .codecs import codec_class
from .layouts import layout_class

SWAP_ALIASES = {"nvme_path": "folder", "pin_memory": "pin"}


@dataclass(frozen=True)
class SwapConfig:
    """Where and how tensors are swapped to storage.

    Attributes:
        aio: how bytes move (block size, queue depth, threads, engine); see ``AioConfig``.
        folder: the base folder for swap files (None: the system temp folder). Each run gets its own sub-folder
            there. A missing folder is created, but not its parents (a mistyped path is an error, not a new tree on
            another disk); a folder on tmpfs gets a warning (its files stay in memory). A list of folders (one per
            drive) is kept as a tuple and selects the ``drives`` layout: records spread over every folder, each
            folder's drive with its own IO queue; there every folder must exist. A list of one is that folder.
        buffer_count: aligned staging buffers in the pool (the pipeline uses 3: read ahead, step, write behind).
        chunk_bytes: bytes of optimizer state per pipelined chunk, and the size of each pooled buffer (page-aligned).
            Peak memory of an offloaded step is about ``buffer_count * chunk_bytes``, whatever the model size; an
            ``OffloadedOptimizer`` whose largest parameter's state exceeds ``chunk_bytes`` grows its buffers to its
            largest chunk (that state, plus at most a sixteenth), so they are reused rather than made afresh each
            step.
        pin: page-lock the buffers (faster IO; needs RLIMIT_MEMLOCK, warns and carries on unlocked without it).
        checksum: hash every tensor at swap-out (xxh3-64) and check it at swap-in; a changed byte is an error.
        keep_files: leave the swap files when closing (for inspection); by default they are removed on close and at
            interpreter exit.
        trust_folder_owner: accept a base ``folder`` that another user owns (or a link to it that another user
            owns, or one every user may change without the sticky bit). Refused by default: whoever can rename
            entries there can replace this run's folder with a link to theirs and read or change the swap files.
            Turns ``checksum`` on (a changed byte read back is then a ``ChecksumError``; xxh3 detects changes, it
            is not a cryptographic signature).
        layout: the storage layout (where records live), by its registered name: ``folder`` (one run folder under
            ``folder``), ``drives`` (a run folder in each of several folders, records spread over them; chosen
            when ``folder`` is a list); see ``deepoffload.swap.layouts``.
        codec: how a group's bytes are stored, by the byte codec's registered name: ``none`` (as they are) or
            ``lossless`` (bf16/fp16 exponent byte plane compressed, values unchanged; needs ``deepoffload[codec]``); see
            ``deepoffload.swap.codecs``. A packed swapper (the optimizer's) takes ``none`` only.
        folder_speeds: with several folders, each one's measured speed (GB/s, in ``folder``'s order; what
            ``deepoffload tune --folder A --folder B`` writes): each drive gets that share of the records. None:
            equal shares.

    Raises:
        ConfigError: When a value has the wrong type or range (the message names the key), or ``aio.engine``,
            ``layout`` or ``codec`` names nothing registered (the message lists what is).

    Examples:
        >>> from deepoffload import SwapConfig
        >>> config = SwapConfig(folder="swap", chunk_bytes=1 << 20, pin=False)
        >>> config.buffer_count, config.chunk_bytes, config.folder
        (4, 1048576, 'swap')
        >>> SwapConfig.from_dict({"nvme_path": "swap", "block_size": 4096}).aio.block_size
        4096
        >>> config.replace(checksum=True).checksum
        True
    """

    aio: AioConfig = field(default_factory=AioConfig.from_env)
    folder: str | tuple[str, ...] | None = None
    buffer_count: int = 4
    chunk_bytes: int = 32 << 20
    pin: bool = True
    checksum: bool = False
    keep_files: bool = False
    trust_folder_owner: bool = False
    layout: str = "folder"
    codec: str = "none"
    folder_speeds: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.aio, AioConfig):
            raise ConfigError(f"aio: expected an AioConfig, got {type(self.aio).__name__}")
        check_choice(self.aio.engine)  # a registered engine (AioConfig, lower down, cannot see the registry)
        object.__setattr__(self, "folder", _folders(self.folder))
        if isinstance(self.folder, tuple) and self.layout == "folder":
            object.__setattr__(self, "layout", "drives")  # several folders: the layout made for them
        positive_int("buffer_count", self.buffer_count)
        positive_int("chunk_bytes", self.chunk_bytes)
        for key in ("pin", "checksum", "keep_files", "trust_folder_owner"):
            check_bool(key, getattr(self, key))
        for key, lookup in (("layout", layout_class), ("codec", codec_class)):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{key}: expected the name of a registered {key}, got {value!r}")
            lookup(value)  # ConfigError naming the key and the registered names
        object.__setattr__(self, "folder_speeds", _speeds(self.folder_speeds, self.folder))

    @classmethod
    def swap_keys(cls) -> tuple[str, ...]:
        """The names of the swap keys: every field but ``aio``, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "aio")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "SwapConfig":
        """Build from swap keys plus ``aio`` keys (top level and/or an ``aio`` section); unknown keys are errors.

        Args:
            values: swap keys (or their aliases ``nvme_path``, ``pin_memory``) and aio keys, at top level and/or
                under an ``aio`` section.

        Returns:
            The config.

        Raises:
            ConfigError: When ``values`` is not a mapping, the ``aio`` section is not one, a key is unknown, or a key
                is given twice (under its name and its alias, or at top level and in the ``aio`` section).
        """
        if not isinstance(values, Mapping):
            raise ConfigError(f"swap config: expected a mapping of keys to values, got {type(values).__name__}")
        swap: dict[str, Any] = {}
        aio: dict[str, Any] = {}
        section = values.get("aio", {})
        if not isinstance(section, Mapping):
            raise ConfigError(f"aio: expected a section of aio keys, got {section!r}")
        aio_keys = AioConfig.keys() + tuple(AIO_ALIASES)
        for key, value in values.items():
            if key == "aio":
                continue
            name = SWAP_ALIASES.get(key, key)
            if name in cls.swap_keys():
                if name in swap:
                    raise ConfigError(f"{key}: given twice (as {name!r} and its alias)")
                swap[name] = value
            elif key in aio_keys:
                aio[key] = value
            else:
                raise ConfigError(
                    f"unknown swap config key {key!r}; accepted: "
                    f"{', '.join(cls.swap_keys() + tuple(SWAP_ALIASES) + aio_keys + ('aio',))}"
                )
        for key, value in section.items():
            if key in aio:
                raise ConfigError(f"{key}: given both at top level and in the aio section")
            aio[key] = value
        return cls(aio=AioConfig.from_dict(aio), **swap)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "SwapConfig":
        """Read a JSON file of swap and/or aio keys (a ``deepoffload tune`` output loads unchanged).

        Args:
            path: The JSON file.

        Returns:
            The config, as ``from_dict`` builds it.
        """
        return cls.from_dict(read_json(path))

    def replace(self, **changes: Any) -> "SwapConfig":
        """A copy with some swap keys changed (``aio=`` takes an ``AioConfig``).

        Args:
            **changes: The fields to change, by name, with their new values (checked as in the constructor).

        Returns:
            The new config; this one is unchanged.
        """
        return dataclasses.replace(self, **changes)

    @property
    def folders(self) -> tuple[str | None, ...]:
        """``folder`` as a tuple: one entry (a path, or None for the temp folder), or the folders of a list."""
        return self.folder if isinstance(self.folder, tuple) else (self.folder,)

    def to_dict(self) -> dict[str, Any]:
        """Swap keys plus an ``aio`` section; ``from_dict`` reads it back.

        Returns:
            A dict of the swap keys and an ``aio`` dict of the aio keys.
        """
        values = {key: getattr(self, key) for key in self.swap_keys()}
        for key in ("folder", "folder_speeds"):
            if isinstance(values[key], tuple):
                values[key] = list(values[key])  # (JSON has lists)
        values["aio"] = self.aio.to_dict()
        return values


def _folders(folder: Any) -> str | tuple[str, ...] | None:
    """``SwapConfig.folder`` checked: None, one path as a string, or two or more paths as a tuple of strings."""
    if folder is None:
        return None
    paths = list(folder) if isinstance(folder, (list, tuple)) else [folder]
    if not paths:
        raise ConfigError("folder: expected a path to a folder, a list of folders, or null, got an empty list")
    for path in paths:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError(f"folder: expected a path to a folder (or null for the temp folder), got {path!r}")
    names = tuple(os.fspath(p) for p in paths)
    if len(set(names)) != len(names):
        raise ConfigError(f"folder: a folder is listed twice in {list(names)}; list each drive's folder once")
    return names[0] if len(names) == 1 else names


def _speeds(speeds: Any, folder: str | tuple[str, ...] | None) -> tuple[float, ...] | None:
    """``SwapConfig.folder_speeds`` checked: None, or one positive finite number per folder of a list."""
    if speeds is None:
        return None
    count = len(folder) if isinstance(folder, tuple) else 1
    if not isinstance(speeds, (list, tuple)) or len(speeds) != count:
        raise ConfigError(f"folder_speeds: expected one speed per folder ({count}), got {speeds!r}")
    for speed in speeds:
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < float("inf"):
            raise ConfigError(f"folder_speeds: expected positive numbers (GB/s), got {speeds!r}")
    return tuple(float(s) for s in speeds)
