"""Loading a zip-format ``torch.save`` file by reading it whole, through the async-IO op, straight into one buffer.

No staging copy: the file's bytes land where the tensors will live. torch's own ``_load`` then builds the objects
with every storage a slice of that buffer (what ``torch.load(mmap=True)`` does with a mapped file).

The buffer is anonymous memory advised for transparent huge pages where the system offers them, so filling it
takes far fewer page faults. Tensors share the buffer: its memory is returned once the last of them is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
from typing import Any, cast

import torch
import torch.serialization as ts

from ...io.buffers import aligned_empty, prefault
from ...io.handle import AsyncIOHandle, wait_each
from ...op_builder import env
from .record_check import CheckedStorage, data_records
from .streams import SeekableReader
from .zip_layout import check_layout

TORCH_TRUE = ("1", "y", "yes", "true")  # the values torch.load takes as set for its TORCH_FORCE_* variables


class MemoryFile(SeekableReader):
    """A seekable read-only file over a tensor's bytes (torch's zip reader takes its headers and pickles from it)."""

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__()
        self._data, self.size, self._position = data, data.numel(), 0

    def readinto(self, buffer) -> int:
        """Copy the next bytes into ``buffer``, as ``io.RawIOBase.readinto`` does.

        Args:
            buffer: A writable bytes-like object.

        Returns:
            The bytes copied (0 at the end).
        """
        target = memoryview(buffer).cast("B")
        nbytes = max(0, min(target.nbytes, self.size - self._position))
        if nbytes:
            address = torch.frombuffer(target, dtype=torch.uint8).data_ptr()
            ctypes.memmove(address, self._data.data_ptr() + self._position, nbytes)
        self._position += nbytes
        return nbytes


WHOLE_READ_CHUNK = 64 << 20  # bytes faulted in and submitted at a time


def read_whole(path: str, handle: AsyncIOHandle) -> torch.Tensor:
    """Read the file ``path`` through the op in large requests.

    Each chunk's memory is faulted in before its read is submitted, while the chunks before it are read. A failed
    read raises its ``OSError`` (naming path and offset) once every read submitted has finished.

    Args:
        path: The file.
        handle: The handle to read with.

    Returns:
        The file's bytes, as a page-aligned uint8 tensor.
    """
    size = os.path.getsize(path)
    data = aligned_empty(size, pin=False) if size else torch.empty(0, dtype=torch.uint8)
    requests = []
    try:
        for start in range(0, size, WHOLE_READ_CHUNK):
            chunk = data[start : start + WHOLE_READ_CHUNK]
            prefault(chunk)
            requests.append(handle.read_async(chunk, path, start))
    finally:  # every read submitted finishes before its memory can go
        error = wait_each(requests)
    if error is not None:
        raise error
    return data


def weights_only_default(weights_only: bool | None, pickle_module: Any) -> bool:
    """``weights_only`` as ``torch.load`` resolves it (its default and its environment variables)."""
    explicit = weights_only is not None
    if not explicit:
        weights_only = ts._default_to_weights_only(pickle_module)
    force = str(env.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")).lower() in TORCH_TRUE
    force_not = str(env.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")).lower() in TORCH_TRUE
    if force and not force_not:
        return True
    if force_not and not force and not explicit:
        return False
    return bool(weights_only)


def load_from_memory(
    data: torch.Tensor,
    map_location: Any,
    weights_only: bool,
    pickle_module: Any,
    pickle_load_args: dict,
    path: str = "<memory>",
) -> tuple[bool, Any]:
    """Load the zip-format ``torch.save`` bytes in ``data`` with every storage sliced from it.

    A storage that is not exactly its record's bytes raises ``CheckpointError`` naming ``path``.

    Args:
        data: The whole file's bytes (uint8).
        map_location: As for ``torch.load``.
        weights_only: Whether to unpickle with torch's weights-only unpickler.
        pickle_module: The unpickler otherwise (default: ``pickle``).
        pickle_load_args: Further arguments for the unpickler (``encoding`` defaults to ``"utf-8"``).
        path: The file, named in errors.

    Returns:
        ``(True, objects)``, or ``(False, None)`` when ``torch.load`` itself must handle the file (legacy format,
        TorchScript archive, or a weights-only refusal, whose message ``torch.load`` words).

    Raises:
        UnpicklingError: When unpickling without ``weights_only`` fails (re-raised as is).
    """
    source = MemoryFile(data)
    if not ts._is_zipfile(source):
        return False, None
    check_layout(source, path)
    source.seek(0)
    args = dict(pickle_load_args)
    args.setdefault("encoding", "utf-8")
    # (torch's stub asks IO[bytes]; a binary file object of io's, as source is, is not one to typeshed)
    with ts._open_zipfile_reader(source) as archive:  # type: ignore[arg-type]
        return _load_archive(archive, data.untyped_storage(), map_location, weights_only, pickle_module, args, path)


def load_mapped(
    path: str, map_location: Any, weights_only: bool, pickle_module: Any, pickle_load_args: dict
) -> tuple[bool, Any]:
    """What ``torch.load(path, mmap=True)`` returns, with every storage checked against its record first.

    The file is mapped as torch maps it (``torch.serialization.get_default_mmap_options()``); a storage that is not
    exactly its record's bytes raises ``CheckpointError`` (``torch.load(mmap=True)`` hands out a storage that runs on
    into the zip metadata and the next record).

    Args:
        path: A zip-format ``torch.save`` file.
        map_location: As for ``torch.load``.
        weights_only: Whether to unpickle with torch's weights-only unpickler.
        pickle_module: The unpickler otherwise (default: ``pickle``).
        pickle_load_args: Further arguments for the unpickler (``encoding`` defaults to ``"utf-8"``).

    Returns:
        ``(True, objects)``, or ``(False, None)`` when ``torch.load`` itself must handle the file (as for
        ``load_from_memory``).
    """
    with open(path, "rb") as f:
        if not ts._is_zipfile(f):
            return False, None
        check_layout(f, path)
    shared = os.name != "nt" and ts.get_default_mmap_options() == mmap.MAP_SHARED
    storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(path, shared, os.path.getsize(path)))
    args = dict(pickle_load_args)
    args.setdefault("encoding", "utf-8")
    with ts._open_zipfile_reader(path) as archive:
        return _load_archive(archive, storage, map_location, weights_only, pickle_module, args, path)


def _load_archive(
    archive,
    whole: torch.UntypedStorage,
    map_location: Any,
    weights_only: bool,
    pickle_module: Any,
    args: dict,
    path: str,
) -> tuple[bool, Any]:
    """torch's ``_load`` of ``archive`` with its storages sliced from ``whole`` (the file's bytes), each checked."""
    if ts._is_torchscript_zip(archive):
        return False, None
    unpickler = ts._weights_only_unpickler if weights_only else (pickle_module or pickle)
    try:
        storage = CheckedStorage(whole, data_records(archive), path)
        return True, ts._load(archive, map_location, unpickler, overall_storage=storage, **args)
    except pickle.UnpicklingError:
        if weights_only:
            return False, None
        raise
