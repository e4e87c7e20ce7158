"""Reading a DCP checkpoint's ``.metadata`` without trusting it: an allow-listed unpickler and checked entries.

DCP's own reader unpickles ``.metadata`` with ``pickle.load`` (a payload in it runs) and opens every file an entry
names, ``../x.distcp`` and absolute paths included. ``read_metadata`` unpickles it with ``MetadataUnpickler``, which
finds only the classes DCP's metadata is made of (as ``torch.load(weights_only=True)`` does for tensors), and
``check_metadata`` refuses a metadata whose structure DCP cannot have written or whose entries name a file outside
the checkpoint's folder (links resolved) or bytes past a file's end. Each refusal is a ``CheckpointError`` naming the
file and the entry.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import pickletools
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import CheckpointError

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and every dtype (below)
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},  # StorageMeta's id
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that finds only the classes of DCP's metadata (``_ALLOWED``) and torch's dtypes.

    Any other global (``os.system``, ``builtins.eval``, ...) raises ``pickle.UnpicklingError`` naming it, before
    it could be called.
    """

    def find_class(self, module: str, name: str) -> Any:
        """Return the allowed global ``module.name``.

        Args:
            module: The module the pickle names.
            name: The name in it.

        Returns:
            The class, function or dtype.

        Raises:
            UnpicklingError: When ``module.name`` is not on the allow-list.
        """
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a class DCP's metadata is made of")


def read_metadata(stream: Any, path: str, trusted: bool) -> Metadata:
    """Unpickle a ``.metadata`` file with ``MetadataUnpickler`` (or ``pickle`` when ``trusted``) and check its type.

    Args:
        stream: The open file (binary, readable).
        path: Its path, named in errors.
        trusted: Unpickle with ``pickle.load`` as DCP's own reader does (any class; only for files you trust).

    Returns:
        The metadata.

    Raises:
        CheckpointError: When it cannot be unpickled (damaged, or naming a class off the allow-list) or is not a
            ``Metadata``.
        OSError: When reading the file fails (as it is).
    """
    try:
        if trusted:
            metadata = pickle.load(stream)
        else:
            data = stream.read()
            _check_memo_indices(data, path)
            metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except (OSError, CheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises nearly anything
        hint = "" if trusted else "; a file you trust may be read with FileSystemReader(..., trust_metadata=True)"
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {e}{hint}") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"cannot load {path}: it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _check_memo_indices(data: bytes, path: str) -> None:
    """Refuse a pickle whose memo indices run ahead of the objects stored so far, before unpickling it.

    The C unpickler grows its memo to the index a ``PUT`` names and clears every new slot: a crafted ``LONG_BINPUT``
    of 2**30 has it allocate and write 8 GiB before any class is looked up. ``pickle`` numbers memo entries from 0 in
    order, so an index past the count stored so far comes from no pickler. ``pickletools.genops`` walks the opcodes
    without building anything.

    Raises:
        CheckpointError: When an index runs ahead, or the opcodes cannot be read.
    """
    stored = 0
    try:
        for opcode, arg, position in pickletools.genops(data):  # noqa: B007 - position is named after the loop
            if opcode.name == "MEMOIZE":
                stored += 1
            elif opcode.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                if not isinstance(arg, int) or arg > stored:
                    break
                stored = max(stored, arg + 1)
        else:
            return
    except (ValueError, EOFError) as e:
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {e}") from e
    raise CheckpointError(
        f"cannot load {path}: memo index {arg} at byte {position} runs ahead of the {stored} objects stored so far "
        "(no pickler writes that: the file is damaged or crafted)"
    )


def check_metadata(metadata: Metadata, folder: str, path: str) -> None:
    """Refuse ``metadata`` (read from ``path``) unless every entry is well formed and reads inside ``folder``.

    Every storage entry must name a file inside ``folder`` (no absolute path, no ``..``, no link out of it) and a
    byte range inside that file; every tensor's chunks must lie inside its shape and have a storage entry.

    Args:
        metadata: The unpickled metadata.
        folder: The checkpoint's folder.
        path: The ``.metadata`` file, named in errors.

    Raises:
        CheckpointError: Naming ``path`` and the entry.
    """
    problem = _storage_problem(metadata, folder) or _tensors_problem(metadata)
    if problem is not None:
        raise CheckpointError(f"cannot load {path}: {problem} (the file is damaged or was crafted)")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _storage_problem(metadata: Metadata, folder: str) -> str | None:
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return f"its storage_data is a {type(storage).__name__}, not a dict"
    root = os.path.realpath(folder)
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return f"storage entry {index!r} is not a MetadataIndex and _StorageInfo"
        name = info.relative_path
        if not isinstance(name, str) or not name or "\0" in name:
            return f"storage entry {index.fqn!r} names no file ({name!r})"
        if name not in sizes:
            parts = pathlib.PurePath(name).parts
            inside = os.path.realpath(os.path.join(root, name))
            if os.path.isabs(name) or ".." in parts or os.path.commonpath([root, inside]) != root:
                return f"storage entry {index.fqn!r} names {name!r}, outside the checkpoint's folder"
            try:
                sizes[name] = os.stat(inside).st_size
            except OSError as e:
                return f"storage entry {index.fqn!r} names {name!r}, which cannot be read ({e.strerror})"
        descriptors = info.transform_descriptors
        if descriptors is not None and not all(isinstance(d, str) for d in descriptors):
            return f"storage entry {index.fqn!r} has transform descriptors that are not names"
        if not _is_count(info.offset) or not _is_count(info.length) or info.offset + info.length > sizes[name]:
            return (
                f"storage entry {index.fqn!r} reads bytes {info.offset}..+{info.length} of {name!r}, "
                f"which holds {sizes[name]}"
            )
    return None


def _tensors_problem(metadata: Metadata) -> str | None:
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        return f"its state_dict_metadata is a {type(entries).__name__}, not a dict"
    for key, entry in entries.items():
        if not isinstance(key, str):
            return f"entry {key!r} is not named by a string"
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(key) not in metadata.storage_data:
                return f"entry {key!r} has no storage entry"
            continue
        if not isinstance(entry, TensorStorageMetadata) or not isinstance(entry.size, torch.Size):
            return f"entry {key!r} is a {type(entry).__name__}, not DCP's tensor or bytes metadata"
        if not isinstance(entry.properties, dcp_metadata.TensorProperties) or not isinstance(
            entry.properties.dtype, torch.dtype
        ):
            return f"entry {key!r} has no dtype"
        for chunk in entry.chunks:
            if not _chunk_inside(chunk, entry.size):
                return f"entry {key!r} has a chunk {chunk!r} outside its shape {tuple(entry.size)}"
            if MetadataIndex(key, chunk.offsets) not in metadata.storage_data:
                return f"entry {key!r} has a chunk at {tuple(chunk.offsets)} without a storage entry"
    return None


def _chunk_inside(chunk: Any, size: torch.Size) -> bool:
    if not isinstance(chunk, ChunkStorageMetadata):
        return False
    offsets, sizes = chunk.offsets, chunk.sizes
    if not isinstance(offsets, torch.Size) or not isinstance(sizes, torch.Size) or not len(offsets) == len(sizes):
        return False
    counts = all(_is_count(n) for n in (*offsets, *sizes, *size))
    return counts and len(sizes) == len(size) and all(o + s <= n for o, s, n in zip(offsets, sizes, size))
