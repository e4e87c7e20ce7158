"""``save``, ``save_async`` and ``load``: ``torch.save``/``torch.load`` with the bytes moved by the async-IO op.

Saves never leave a half-written file under the checkpoint's name.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
import torch.serialization as ts

from ..config import AioConfig
from ..errors import CheckpointError, CheckpointNotFoundError, UnsupportedError
from ..formats.header import file_identity
from ..formats.torch_zip.streams import DirectReader, shared_handle
from ..formats.torch_zip.torch_format import (
    not_a_checkpoint,
    record,
    snapshot,
    snapshot_bytes,
)
from ..formats.torch_zip.whole_file import load_from_memory, load_mapped, read_whole, weights_only_default
from ..formats.torch_zip.write_file import write_file
from ..formats.torch_zip.zip_crc import ZipChecksums
from ..formats.torch_zip.zip_layout import check_layout
from ..io.buffers import aligned_empty
from ..pending import PendingFuture

_write_file = write_file  # (the one name save and save_async call it by, which tests hold)
LOAD_ATTEMPTS = 3  # reads of a file that another process replaces (or rewrites) while it is read, before giving up
_executor: ThreadPoolExecutor | None = None
_async_lock = threading.Lock()
_last_async: PendingFuture | None = None
_arena: torch.Tensor | None = None  # save_async's snapshot memory, kept for the next call (under _async_lock)
_arena_pinned = False


def save(
    obj: object, path: str | os.PathLike, *, checksum: bool = True, sync: bool = True, config: AioConfig | None = None
) -> None:
    """Write ``obj`` to ``path`` exactly as ``torch.save(obj, f)`` would write it to a file object.

    ``torch.load`` reads the file. It is written to a temporary name in the same folder through the async-IO op
    (large aligned writes from several staging buffers), fsynced, renamed over ``path`` and the folder fsynced; a
    replaced file of 64 MiB or more is freed on a background thread (``deepoffload.io.retire``), not inside the
    rename. Any failure (full disk, missing folder, no permission) raises ``OSError`` naming ``path``, and a previous
    file under ``path`` is left as it was; a file object or buffer instead of a path raises ``TypeError`` (use
    ``torch.save`` for those). A ``save_async`` still being written is waited for first, so files land in call order.

    Args:
        obj: What to save (anything ``torch.save`` takes: tensors, state dicts, nested containers).
        path: The file to write (a ``str`` or ``os.PathLike``; a symbolic link is written through, as
            ``torch.save`` does).
        checksum: Store each record's CRC-32 (as ``torch.save`` does); ``load(..., checksum=True)`` verifies them.
        sync: Fsync the file and its folder; ``False`` skips both fsyncs: the rename is still atomic, but a power
            loss may lose the file.
        config: The async-IO settings for the write (default: ``AioConfig.from_env()``).

    Examples:
        >>> import torch, deepoffload
        >>> deepoffload.save({"weight": torch.arange(4.0)}, "model.pt")
        >>> torch.load("model.pt")["weight"]
        tensor([0., 1., 2., 3.])
    """
    path = _path_of(path, "save")
    records = record(obj)
    _wait_for_save_async()  # else its rename, coming later, would put the older checkpoint back under the path
    _write_file(records, path, checksum, sync, config)


def save_async(
    obj: object, path: str | os.PathLike, *, checksum: bool = True, sync: bool = True, config: AioConfig | None = None
) -> PendingFuture[str]:
    """Like ``save``, but return as soon as ``obj`` has been copied to staging memory.

    The file is written on a background thread. ``obj`` (its tensors included) may be changed as soon as this
    returns: the file holds its state at the call. One save is written at a time, in order; a call made while the
    previous save is still being written waits for it first, so staging memory holds at most one checkpoint. That
    memory (huge pages where the system has them; page-locked when a tensor is on an accelerator) is kept and reused
    by the next call, so a training loop's saves after the first block only for the copy, not for the kernel's first
    touch of new memory; it grows to the largest checkpoint saved this way. Pending saves complete before the
    interpreter exits. A file object or buffer instead of a path raises ``TypeError`` here, at the call.

    Args:
        obj: What to save (anything ``torch.save`` takes).
        path: The file to write (a ``str`` or ``os.PathLike``).
        checksum: Store each record's CRC-32, as ``save`` does.
        sync: Fsync the file and its folder, as ``save`` does.
        config: The async-IO settings for the write (default: ``AioConfig.from_env()``).

    Returns:
        A future (a ``concurrent.futures.Future`` that is also ``Pending``: ``wait(timeout=None)``, ``done()``,
        ``result(timeout=None)``) that gives ``path`` once the file is in place, or raises the write's ``OSError``
        (naming ``path``).

    Examples:
        >>> import torch, deepoffload
        >>> state = {"step": 1, "weight": torch.ones(3)}
        >>> future = deepoffload.save_async(state, "step1.pt")
        >>> state["weight"].zero_()  # the file keeps the values at the call
        tensor([0., 0., 0.])
        >>> future.wait()
        'step1.pt'
        >>> deepoffload.load("step1.pt")
        {'step': 1, 'weight': tensor([1., 1., 1.])}
    """
    global _executor, _last_async
    path = _path_of(path, "save")
    with _async_lock:
        previous = _last_async
        if previous is not None:
            wait_futures([previous])  # after it, nothing uses the arena
        records = record(obj)
        records = snapshot(records, _snapshot_arena(*snapshot_bytes(records)))
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepoffload-save")
        future: PendingFuture[str] = PendingFuture()
        _executor.submit(future.run, _write_file, records, path, checksum, sync, config)
        _last_async = future
        return future


def load(
    path: str | os.PathLike,
    map_location: Any = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    checksum: bool = False,
    config: AioConfig | None = None,
    **pickle_load_args: Any,
) -> Any:
    """Read a ``torch.save`` file (any, not only ours); its tensor bytes are read through the async-IO op.

    A zip-format file loaded to host memory is read whole, in large requests, into one buffer, and every storage is
    a slice of it (as with ``torch.load(mmap=True)``): the buffer's memory is returned once all its tensors are gone,
    and storages cannot be resized. Other files and ``map_location`` to a device are read through read-ahead. A
    ``.safetensors`` path is read by ``deepoffload.formats.load_file`` (``torch.load`` reads such a path with the
    safetensors library). A ``save_async`` still being written is waited for first. A file replaced or rewritten
    while it is read (another process saving to the same path) is read again, whole. A file object or buffer instead
    of a path raises ``TypeError`` (use ``torch.load`` for those).

    Args:
        path: The file to read (a ``str`` or ``os.PathLike``).
        map_location: Where storages go, as for ``torch.load`` (a device, a dict or a function; a ``.safetensors``
            file takes a device only).
        weights_only: As for ``torch.load`` (default: torch's default).
        mmap: ``True`` maps the file as ``torch.load(mmap=True)`` does instead (storages mapped from the file,
            nothing read through the op), each storage checked against its record as without ``mmap``.
        checksum: Verify the CRC-32 stored with every record; a mismatch (or a file that recorded none) raises
            ``ChecksumError``.
        config: The async-IO settings for the reads (default: ``AioConfig.from_env()``).
        **pickle_load_args: Passed on to ``torch.load`` (``pickle_module``, ``encoding``, ...).

    Returns:
        What ``torch.load(path, map_location, weights_only=weights_only)`` returns.

    Raises:
        CheckpointNotFoundError: (also a ``FileNotFoundError``, as ``torch.load`` raises) When ``path`` does not exist.
        CheckpointError: When the file cannot be a checkpoint (empty, truncated, safetensors, other data; the
            message names it and why), or when it was replaced while being read ``LOAD_ATTEMPTS`` times in a row.

    Examples:
        >>> import torch, deepoffload
        >>> torch.save({"weight": torch.arange(3)}, "model.pt")
        >>> deepoffload.load("model.pt", checksum=True)
        {'weight': tensor([0, 1, 2])}
    """
    path = _path_of(path, "load")
    _wait_for_save_async()  # else this would read the checkpoint before it (or find none)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(errno.ENOENT, "no such checkpoint file", path) from None
    try:
        if mmap or path.endswith(".safetensors"):  # one mapping of one file / a reader that checks the file itself
            return _load(path, map_location, weights_only, mmap, checksum, config, pickle_load_args)
        for _ in range(LOAD_ATTEMPTS):  # the op reads by path: a file replaced meanwhile would be read in part
            before = file_identity(os.stat(path))
            result = _load(path, map_location, weights_only, mmap, checksum, config, pickle_load_args)
            if file_identity(os.stat(path)) == before:
                return result
            del result
        raise CheckpointError(
            f"cannot load {path}: it was replaced or rewritten while being read, "
            f"{LOAD_ATTEMPTS} times in a row; load it once its writer is done"
        )
    except CheckpointError:
        raise  # already says what is wrong with the file (a guess from its first bytes would hide it)
    except Exception as e:
        reason = not_a_checkpoint(path)
        if reason is None and isinstance(e, RuntimeError) and any(mark in str(e) for mark in _ZIP_READER):
            reason = str(e)  # torch's zip reader refused the file, without naming it
        if reason is None:
            raise
        raise CheckpointError(f"cannot load {path}: {reason}") from e


_ZIP_READER = ("PytorchStreamReader", "inline_container.cc")  # what torch's zip reader's errors say


def _load(
    path: str,
    map_location: Any,
    weights_only: bool | None,
    mmap: bool | None,
    checksum: bool,
    config: AioConfig | None,
    pickle_load_args: dict,
) -> Any:
    if path.endswith(".safetensors"):  # as torch.load does since torch 2.10
        return _load_safetensors(path, map_location, checksum)
    verifier = ZipChecksums(path) if checksum else None
    pickle_module = pickle_load_args.get("pickle_module")
    resolved = weights_only_default(weights_only, pickle_module)
    args = {k: v for k, v in pickle_load_args.items() if k != "pickle_module"}
    if mmap:
        done, result = False, None
        if not (resolved and pickle_module is not None):  # (torch.load refuses that pair, in its words)
            done, result = load_mapped(path, map_location, resolved, pickle_module, args)
        if not done:
            result = torch.load(path, map_location, weights_only=weights_only, mmap=True, **pickle_load_args)
        if verifier is not None:
            verifier.finish()
        return result
    if _on_cpu(map_location) and not (resolved and pickle_module is not None):
        data = read_whole(path, shared_handle(config))
        if verifier is not None:
            verifier.verify_memory(data)
        done, result = load_from_memory(data, map_location, resolved, pickle_module, args, path)
        if done:
            return result
        del data
    with open(path, "rb") as f:  # (torch.load checks the layout of no file it reads as a stream)
        if ts._is_zipfile(f):
            check_layout(f, path)
    with DirectReader(path, config=config, on_read=verifier.on_read if verifier else None) as reader:
        try:
            # (torch's stub asks IO[bytes]; an io.RawIOBase file, as reader is, is not one to typeshed)
            result = torch.load(
                reader,  # type: ignore[arg-type]
                map_location=map_location,
                weights_only=weights_only,
                **pickle_load_args,
            )
        except Exception as e:
            if reader.error is not None:  # what torch reports then is a consequence, not the cause
                raise reader.error from e
            raise
    if verifier is not None:
        verifier.finish()
    return result


def _load_safetensors(path: str, map_location: Any, checksum: bool) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file's tensors, read through the op, placed where ``map_location`` (a device) says."""
    from ..formats import load_file  # (imported here: most loads never need it)

    if checksum:
        raise ValueError(f"{path}: a safetensors file records no checksums to verify; load it with checksum=False")
    if isinstance(map_location, dict) or callable(map_location):
        raise UnsupportedError(
            f"cannot load {path}: a safetensors file takes a device as map_location (as with "
            f"torch.load), not a {type(map_location).__name__}"
        )
    tensors = load_file(path)
    if map_location is None or _on_cpu(map_location):
        return tensors
    return {name: tensor.to(map_location) for name, tensor in tensors.items()}


def _path_of(path: Any, verb: str) -> str:
    """``path`` as a string, or a ``TypeError`` saying that these functions take paths, not file objects."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(
            f"deepoffload.{verb} takes a file path (str or os.PathLike), not {type(path).__name__}; "
            f"use torch.{verb} for file objects and buffers"
        )
    return os.fsdecode(path)


def _wait_for_save_async() -> None:
    """Return once every ``save_async`` called before has finished (its error stays in its future)."""
    with _async_lock:
        pending = _last_async
    if pending is not None:
        wait_futures([pending])


def _snapshot_arena(nbytes: int, pin: bool) -> torch.Tensor:
    """Return at least ``nbytes`` bytes of save_async's snapshot memory, page-locked when ``pin``.

    Call under ``_async_lock`` once the previous save has completed.

    Args:
        nbytes: The bytes needed.
        pin: Whether the memory must be page-locked.

    Returns:
        The kept arena when it is large enough (and pinned when asked), else a new one that is kept instead.
    """
    global _arena, _arena_pinned
    if _arena is None or _arena.numel() < nbytes or (pin and not _arena_pinned):
        _arena = None  # the old one's memory goes back first
        _arena = aligned_empty(max(nbytes, 1), pin=pin)
        _arena_pinned = pin
    return _arena


def _after_fork_in_child() -> None:
    """Give a forked child its own save thread and lock: it has no copy of the parent's save thread.

    Its saves then never wait for one the parent started (that wait would never end). The arena is the child's own
    copy (copy-on-write).
    """
    global _executor, _last_async, _async_lock
    _executor, _last_async, _async_lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _on_cpu(map_location: Any) -> bool:
    """Whether every storage stays in host memory (then the whole file is read into one buffer they share)."""
    if map_location is None:
        return True
    try:
        return torch.device(map_location).type == "cpu"
    except (TypeError, RuntimeError):
        return False  # a dict or a function: torch.load's own path
