"""The registry of checkpoint formats: every reader finds a path's format here, and every list of formats is this one.

Formats are tried in order: those registered by ``register_format`` first (newest first), then the built-in ones
(``CHECKPOINT_FORMATS``' starting order: sharded safetensors, ``torch.save``, safetensors, DCP). The first whose
``detect`` accepts a path opens it. Safetensors accepts every file the formats before it left, so that a damaged
file is told what is wrong with it as safetensors.

To add a format: write a ``CheckpointFormat`` subclass in a file of its own and pass an instance to
``register_format`` (``deepoffload/formats/builtin/`` holds the built-in ones, registered below).
"""

from __future__ import annotations

import errno
from pathlib import Path

from ..errors import CheckpointNotFoundError
from .builtin.dcp_folder import DcpFolder
from .builtin.hf_sharded import HfSharded
from .builtin.safetensors_file import SafetensorsFile
from .builtin.torch_save import TorchSave
from .protocol import CheckpointFormat

BUILTIN: tuple[CheckpointFormat, ...] = (HfSharded(), TorchSave(), SafetensorsFile(), DcpFolder())
CHECKPOINT_FORMATS: list[CheckpointFormat] = list(BUILTIN)  # in the order they are tried


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add ``fmt`` to the registry, tried before every format registered earlier and the built-in ones.

    Args:
        fmt: An instance of a ``CheckpointFormat`` subclass.

    Returns:
        ``fmt``.

    Raises:
        TypeError: When ``fmt`` is not a ``CheckpointFormat``.
        ValueError: When a registered format already has its name.

    Examples:
        See ``CheckpointFormat`` for a whole format; registering one twice is refused:

        >>> from deepoffload.formats import get_format, register_format
        >>> register_format(get_format("torch"))
        Traceback (most recent call last):
        ...
        ValueError: a checkpoint format named 'torch' is registered already; unregister it first
    """
    if not isinstance(fmt, CheckpointFormat):
        raise TypeError(f"register_format takes a CheckpointFormat instance, not {type(fmt).__name__}")
    if any(known.name == fmt.name for known in CHECKPOINT_FORMATS):
        raise ValueError(f"a checkpoint format named {fmt.name!r} is registered already; unregister it first")
    CHECKPOINT_FORMATS.insert(0, fmt)
    return fmt


def unregister_format(name: str) -> CheckpointFormat:
    """Remove the format named ``name`` from the registry.

    Args:
        name: The format's ``name``.

    Returns:
        The format removed.

    Raises:
        KeyError: When no registered format has that name.

    Examples:
        >>> from deepoffload.formats import get_format, register_format, unregister_format
        >>> class Nothing(type(get_format("dcp"))):
        ...     name = "nothing"
        ...     def detect(self, path):
        ...         return False
        >>> _ = register_format(Nothing())
        >>> unregister_format("nothing").name
        'nothing'
    """
    fmt = get_format(name)
    CHECKPOINT_FORMATS.remove(fmt)
    return fmt


def checkpoint_formats() -> tuple[CheckpointFormat, ...]:
    """Return the registered formats, in the order they are tried.

    Returns:
        The formats, first tried first.

    Examples:
        >>> from deepoffload.formats import checkpoint_formats
        >>> [f.name for f in checkpoint_formats()]
        ['safetensors-sharded', 'torch', 'safetensors', 'dcp']
    """
    return tuple(CHECKPOINT_FORMATS)


def get_format(name: str) -> CheckpointFormat:
    """Return the registered format named ``name``.

    Args:
        name: The format's ``name``.

    Returns:
        The format.

    Raises:
        KeyError: When no registered format has that name, listing those that are.

    Examples:
        >>> from deepoffload.formats import get_format
        >>> get_format("safetensors").description
        'a .safetensors file, or a folder holding model.safetensors'
    """
    for fmt in CHECKPOINT_FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(f"no checkpoint format named {name!r}; registered: {', '.join(f.name for f in CHECKPOINT_FORMATS)}")


def detect_format(path: str | Path) -> CheckpointFormat:
    """Return the first registered format that accepts ``path``.

    Args:
        path: A checkpoint file or folder.

    Returns:
        Its format.

    Raises:
        CheckpointNotFoundError: (a ``CheckpointError`` and a ``FileNotFoundError``) When ``path`` does not exist, or
            no registered format accepts it (a folder with no checkpoint in it), listing what each format reads.

    Examples:
        >>> import torch
        >>> from deepoffload.formats import detect_format, save_sharded
        >>> _ = save_sharded({"a": torch.ones(2), "b": torch.ones(2)}, "sharded", max_shard_bytes=8)
        >>> detect_format("sharded").name
        'safetensors-sharded'
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(errno.ENOENT, "no such checkpoint file or folder", str(path))
    for fmt in CHECKPOINT_FORMATS:
        if fmt.detect(path):
            return fmt
    raise CheckpointNotFoundError(
        errno.ENOENT,
        "no model.safetensors.index.json or model.safetensors in this folder, nor a checkpoint of another format; "
        "pass " + "; or ".join(f.description for f in CHECKPOINT_FORMATS),
        str(path),
    )
