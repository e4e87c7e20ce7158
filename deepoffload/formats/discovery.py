"""Finding what a checkpoint path holds: a safetensors file, a Hugging Face sharded folder or a torch.save file.

A sharded folder's index and the shards it lists are checked against each other; a ``torch.save`` file must hold a
state dict.
"""

from __future__ import annotations

import collections
import errno
import json
from pathlib import Path

import torch

from .header import CheckpointError, CheckpointNotFoundError, Header, read_header
from .torch_zip.whole_file import load_mapped

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _is_torch_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _find_index(folder: Path) -> Path | None:
    if (folder / INDEX_NAME).is_file():
        return folder / INDEX_NAME
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(
            f"{folder}: several safetensors index files ({', '.join(p.name for p in indexes)}); pass the one to load"
        )
    return indexes[0] if indexes else None


def _read_index(index: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name), validated."""
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


def _open_sharded(index: Path) -> list[Header]:
    weight_map = _read_index(index)
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


def load_torch(path: Path) -> dict[str, torch.Tensor]:
    """Map a ``torch.save`` state dict into memory (``mmap=True``, ``weights_only=True``, to the CPU).

    Args:
        path: The ``torch.save`` file.

    Returns:
        The state dict: a flat dict of name -> tensor, whose storages are mapped from the file.

    Raises:
        CheckpointError: When torch cannot load the file so, a storage is not exactly its record's bytes, or it holds
            anything but a flat dict of name -> tensor.
    """
    try:  # torch.load(mmap=True) with every storage checked against its record, as deepoffload.load does
        done, state = load_mapped(str(path), "cpu", True, None, {})
        if not done:  # a TorchScript archive, or what the weights-only unpickler refuses: torch says why
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except CheckpointError:
        raise  # names the file, the record and both sizes
    except Exception as e:
        raise CheckpointError(
            f"{path}: cannot load it as a torch.save state dict (read with mmap=True, weights_only=True): {e}"
        ) from None
    if not _is_state_dict(state):
        inside = [k for k, v in state.items() if _is_state_dict(v)] if isinstance(state, dict) else []
        hint = (
            f": a dict holding state dicts under {inside}; save the model's alone (torch.save(saved[{inside[0]!r}], "
            f"path)) to stream from it (`deepoffload plan --key {inside[0]}` reads it as it is)"
            if inside
            else ""
        )
        raise CheckpointError(
            f"{path}: a torch.save checkpoint must hold a flat dict of name -> tensor "
            f"(a state_dict); got {type(state).__name__}{hint}"
        )
    return state


def _is_state_dict(value: object) -> bool:
    """Whether ``value`` is a flat dict of name -> tensor."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
