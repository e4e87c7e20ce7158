"""A Hugging Face sharded safetensors folder: ``model.safetensors.index.json`` beside the shards it lists.

The index and the shards are checked against each other at open.
"""

from __future__ import annotations

import collections
import errno
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from ...errors import CheckpointError, CheckpointNotFoundError
from ..protocol import CheckpointFormat, OpenedCheckpoint

if TYPE_CHECKING:  # (torch and the readers are imported by the methods: listing the registry stays cheap)
    import torch

    from ..header import Header

INDEX_NAME = "model.safetensors.index.json"
INDEX_SUFFIX = ".index.json"


class HfSharded(CheckpointFormat):
    """Sharded safetensors: a folder with its index, or the index file itself."""

    name = "safetensors-sharded"
    description = "a folder of sharded safetensors with its model.safetensors.index.json (or that index file)"
    writes = True
    serves = True

    def detect(self, path: Path) -> bool:
        """Return whether ``path`` is an ``*.index.json`` file or a folder holding a safetensors index.

        Args:
            path: The path given to a reader.

        Returns:
            Whether it is one of this format's checkpoints.
        """
        if path.is_dir():
            return (path / INDEX_NAME).is_file() or next(path.glob("*.safetensors" + INDEX_SUFFIX), None) is not None
        return path.name.endswith(INDEX_SUFFIX)

    def open(self, path: Path) -> OpenedCheckpoint:
        """Read the index and every shard's header, checking they agree.

        Args:
            path: The folder or the index file.

        Returns:
            The shards' tensors, shard by shard.
        """
        index = find_index(path) if path.is_dir() else path
        headers = open_sharded(index)
        return OpenedCheckpoint(files=tuple(headers), metadata=headers[0].metadata if len(headers) == 1 else None)

    def save(self, tensors: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
        """Write ``tensors`` as shards and an index in the folder ``path`` (``deepoffload.formats.save_sharded``).

        Args:
            tensors: Name -> tensor.
            path: The folder.
        """
        from ..writer import save_sharded

        save_sharded(tensors, path)


def find_index(folder: Path) -> Path:
    """Return the folder's safetensors index.

    Args:
        folder: A folder ``HfSharded.detect`` accepted.

    Returns:
        ``model.safetensors.index.json``, else the one ``*.safetensors.index.json``.

    Raises:
        CheckpointError: When the folder holds several index files and no ``model.safetensors.index.json``.
        CheckpointNotFoundError: When it holds none.
    """
    if (folder / INDEX_NAME).is_file():
        return folder / INDEX_NAME
    indexes = sorted(folder.glob("*.safetensors" + INDEX_SUFFIX))
    if len(indexes) > 1:
        raise CheckpointError(
            f"{folder}: several safetensors index files ({', '.join(p.name for p in indexes)}); pass the one to load"
        )
    if not indexes:
        raise CheckpointNotFoundError(errno.ENOENT, f"no {INDEX_NAME} in this folder", str(folder))
    return indexes[0]


def read_index(index: Path) -> dict[str, str]:
    """Read the index's weight_map (tensor name -> shard file name), validated.

    Args:
        index: The index file.

    Returns:
        The weight map.

    Raises:
        CheckpointError: When it is not a safetensors index, or names a shard outside its folder.
    """
    try:
        document = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{index}: cannot read the safetensors index: {e}") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index}: not a safetensors index: expected an object with a 'weight_map' of "
            f"tensor name -> shard file name"
        )
    for shard in set(weight_map.values()):
        if shard in ("", ".", "..") or "/" in shard or "\\" in shard:
            raise CheckpointError(f"{index}: shard name {shard!r} is not a file name in the index's folder")
    return weight_map


def open_sharded(index: Path) -> list[Header]:
    """Read the header of every shard ``index`` lists, checking each holds exactly the tensors listed for it.

    Args:
        index: The index file.

    Returns:
        The shards' headers, by shard file name.

    Raises:
        CheckpointNotFoundError: When a shard is missing.
        CheckpointError: When a shard and the index disagree.
    """
    from ..header import read_header

    weight_map = read_index(index)
    by_shard: dict[str, set[str]] = collections.defaultdict(set)
    for name, shard in weight_map.items():
        by_shard[shard].add(name)
    headers = []
    for shard in sorted(by_shard):
        path = index.parent / shard
        if not path.is_file():
            names = sorted(by_shard[shard])
            raise CheckpointNotFoundError(
                errno.ENOENT,
                f"shard {shard} of {index} is missing (it should hold {len(names)} tensors, e.g. {names[0]!r}); "
                f"the checkpoint is incomplete",
                str(path),
            )
        header = read_header(path)
        listed, stored = by_shard[shard], set(header.entries)
        if listed != stored:
            raise CheckpointError(
                f"{index} and its shard {shard} disagree: listed but not in the shard: "
                f"{sorted(listed - stored)[:10]}; in the shard but not listed: "
                f"{sorted(stored - listed)[:10]}"
            )
        headers.append(header)
    return headers
