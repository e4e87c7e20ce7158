"""Write safetensors checkpoints through the async-IO op, streaming.

Tensors come from an iterator and are copied into page-aligned staging buffers that are written while the next ones
fill, so nothing but the staging buffers (two of ``staging_bytes``) needs to stay in memory.

A shard's header must precede its data, but a stream does not say in advance which tensors a shard will hold, so
each shard reserves ``header_bytes`` for its header (padded with spaces, which the format allows) and starts its
data right after, page-aligned; a shard whose header would outgrow the reservation is closed early and the next one
reserves twice as much. Shards are written under private temporary names and put in place only once all of them
are written and synced, by ``deepoffload.formats.commit`` (``model.safetensors``, or
``model-00001-of-0000N-<generation>.safetensors`` plus ``model.safetensors.index.json``, whose rename switches
readers from the old set to the new one); files of an earlier save with the same prefix are then removed, and so
are the temporaries of saves whose process died.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from ..errors import naming_target
from ..io.buffers import aligned_empty
from ..io.handle import AsyncIOHandle
from ..io.inputs import byte_view
from ..io.owners import adopt_mode, create_private, remove_dead_temporaries, temporary_name
from ..io.staged_file import StagedWriter, StagingPool
from .commit import commit, new_generation, shard_names, sync_folder, write_index
from .header import DTYPE_NAMES, METADATA_KEY, check_little_endian, encode_header, header_shape

DEFAULT_METADATA = {"format": "pt"}  # transformers refuses shards without it
PAGE = 4096


def _entry_bytes(name: str, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int) -> int:
    """Bytes this tensor's entry adds to the compact JSON header (with its comma)."""
    info = {"dtype": DTYPE_NAMES[dtype], "shape": header_shape(dtype, shape), "data_offsets": [begin, end]}
    return len(json.dumps({name: info}, separators=(",", ":"), ensure_ascii=False).encode("utf-8")) - 1


class _ShardFile:
    """One shard being written to a temporary file: its header reservation, its entries and its staging."""

    def __init__(
        self, path: Path, header_bytes: int, metadata: Mapping[str, str], handle: AsyncIOHandle, staging: StagingPool
    ):
        self.path, self.header_bytes, self.handle = path, header_bytes, handle
        self.metadata = dict(metadata)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        self.data_bytes = 0
        meta = json.dumps({METADATA_KEY: self.metadata}, separators=(",", ":"), ensure_ascii=False).encode()
        self.json_bytes = len(meta) if self.metadata else 2  # '{...}' so far
        os.close(create_private(path))
        self.writer = StagedWriter(handle, path, header_bytes, pool=staging)

    def fits_header(self, name: str, tensor: torch.Tensor) -> bool:
        end = self.data_bytes + tensor.numel() * tensor.element_size()
        return (
            8 + self.json_bytes + _entry_bytes(name, tensor.dtype, tuple(tensor.shape), self.data_bytes, end)
            <= self.header_bytes
        )

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        begin, end = self.data_bytes, self.data_bytes + nbytes
        self.json_bytes += _entry_bytes(name, tensor.dtype, tuple(tensor.shape), begin, end)
        self.entries[name] = (tensor.dtype, tuple(tensor.shape), begin, end)
        self.data_bytes = end
        if nbytes:
            self.writer.write(byte_view(tensor).data_ptr(), nbytes)

    def finish(self) -> None:
        """Write the rest of the data, then the header, and sync the file."""
        try:
            self.writer.drain()
        finally:
            self.writer.close()
        header = encode_header(self.entries, self.metadata, reserve=self.header_bytes)
        block = aligned_empty(len(header), pin=False)
        block.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self.handle.write(block, self.path, 0, truncate=False, fsync=True)
        size = os.stat(self.path).st_size
        if size != self.header_bytes + self.data_bytes:  # the writes above leave exactly this; never ship less
            raise OSError(
                f"{self.path}: expected {self.header_bytes + self.data_bytes} bytes after writing, found {size}"
            )

    def abandon(self) -> None:
        self.writer.close()  # waits for the writes in flight; their errors no longer matter
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _items(
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for item in tensors.items() if isinstance(tensors, Mapping) else tensors:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(name, str) or name == METADATA_KEY:
            raise ValueError(f"tensor names must be strings other than {METADATA_KEY!r}, got {name!r}")
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        _check(name, tensor)
        yield name, tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()


def _check(name: str, tensor: object) -> None:
    """Refuse what a safetensors file cannot hold as ``name``: not a tensor, no safetensors dtype, no values."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(
            f"{name!r}: safetensors has no dtype for {tensor.dtype} (supported: "
            f"{', '.join(str(d) for d in DTYPE_NAMES)})"
        )
    if tensor.device.type == "meta":
        raise ValueError(f"{name!r} is on the meta device and has no values to save; materialize it first")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name!r}: {tensor.layout} tensors cannot be saved; pass tensor.to_dense()")
    try:
        header_shape(tensor.dtype, tuple(tensor.shape))
    except ValueError as e:
        raise ValueError(f"{name!r}: {e}") from None


def _checked_metadata(metadata: Mapping[str, str] | None) -> Mapping[str, str]:
    """``metadata`` (default ``DEFAULT_METADATA``), refused unless it maps strings to strings as the format needs."""
    metadata = DEFAULT_METADATA if metadata is None else metadata
    if not isinstance(metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError(f"metadata must map strings to strings, got {metadata!r}")
    return metadata


def _write_shards(
    items: Iterator[tuple[str, torch.Tensor]],
    folder: Path,
    tag: str,
    max_shard_bytes: float,
    header_bytes: int,
    metadata: Mapping[str, str],
    handle: AsyncIOHandle,
    staging_bytes: int,
) -> list[_ShardFile]:
    staging = StagingPool(staging_bytes, keep=2, pin=False)  # two buffers, passed from shard to shard
    shards: list[_ShardFile] = []
    current: _ShardFile | None = None
    try:
        for name, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            if current is not None and (
                current.data_bytes + nbytes > max_shard_bytes or not current.fits_header(name, tensor)
            ):
                if not current.fits_header(name, tensor):
                    header_bytes *= 2
                current.finish()
                current = None
            if current is None:
                while True:  # a fresh shard: make sure even this one entry fits its header
                    current = _ShardFile(
                        folder / f"{tag}-{len(shards) + 1:05d}", header_bytes, metadata, handle, staging
                    )
                    shards.append(current)
                    if current.fits_header(name, tensor):
                        break
                    shards.pop().abandon()
                    header_bytes *= 2
            current.add(name, tensor)
        if current is None:  # nothing to save: still one valid, empty file
            current = _ShardFile(folder / f"{tag}-00001", header_bytes, metadata, handle, staging)
            shards.append(current)
        current.finish()
    except BaseException:
        for shard in shards:
            shard.abandon()
        raise
    return shards


def save_sharded(
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    folder: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 10**9,
    prefix: str = "model",
    metadata: Mapping[str, str] | None = None,
    handle: AsyncIOHandle | None = None,
    header_bytes: int = 64 << 10,
    staging_bytes: int = 16 << 20,
) -> list[Path]:
    """Write ``tensors`` into ``folder`` as safetensors shards, streaming (Hugging Face's layout).

    The shards are ``{prefix}.safetensors``, or ``{prefix}-00001-of-0000N-<generation>.safetensors`` and the index
    ``{prefix}.safetensors.index.json`` that names them (the generation keeps a new set from overwriting the set the
    old index names). On any error, or if the process is killed, readers see the earlier save as it was (see
    ``deepoffload.formats.commit``); what a killed save left is removed by the next save to the folder. A bad tensor
    (not a tensor, a name used twice, a dtype safetensors lacks, a meta or sparse tensor) raises ``TypeError`` or
    ``ValueError`` naming it.

    Args:
        tensors: A mapping or an iterator of ``(name, tensor)``, consumed once, one tensor at a time.
        folder: The folder to write into (made if missing).
        max_shard_bytes: The most data bytes per shard (a larger tensor gets a shard of its own).
        prefix: The file names' start (letters, digits, ``_``, ``.``, ``-``).
        metadata: Strings that go into every shard's header (default ``{"format": "pt"}``, which transformers
            needs).
        handle: An ``AsyncIOHandle`` to write with (default: one made and closed here).
        header_bytes: The bytes each shard first reserves for its header (a multiple of 4096; doubled for the next
            shard when a header outgrows it).
        staging_bytes: The size of each of the two staging buffers (a multiple of 4096).

    Returns:
        The shard paths, in order.

    Raises:
        ValueError: When ``prefix``, ``max_shard_bytes``, ``header_bytes`` or ``staging_bytes`` is not valid.
        OSError: When writing fails (the errno of the failure; the message names ``folder``).
        TimeoutError: When another save into ``folder`` holds its save lock for longer than
            ``deepoffload.io.folder_lock.TIMEOUT_S`` (the message names the folder and that save's process id).

    Examples:
        >>> import torch
        >>> from deepoffload.formats import load_file, save_sharded
        >>> save_sharded({"a": torch.ones(4), "b": torch.zeros(4)}, "model", max_shard_bytes=16)
        [...Path('model/model-00001-of-00002-....safetensors'), ...Path('model/model-00002-of-00002-....safetensors')]
        >>> load_file("model")  # the folder: read through model.safetensors.index.json
        {'a': tensor([1., 1., 1., 1.]), 'b': tensor([0., 0., 0., 0.])}
    """  # noqa: DOC501, DOC502 -- ruff takes naming_target(...) for an exception class; it returns the OSError
    check_little_endian()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
        raise ValueError(f"prefix must be a plain file name part (letters, digits, '_', '.', '-'), got {prefix!r}")
    if not isinstance(max_shard_bytes, (int, float)) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
    if header_bytes < PAGE or header_bytes % PAGE or staging_bytes < PAGE or staging_bytes % PAGE:
        raise ValueError(f"header_bytes and staging_bytes must be positive multiples of {PAGE}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    metadata = _checked_metadata(metadata)
    remove_dead_temporaries(folder, prefix)
    own = handle is None
    if handle is None:
        handle = AsyncIOHandle()
    tag = temporary_name(prefix, "partial")
    try:
        shards = _write_shards(
            _items(tensors), folder, tag, max_shard_bytes, header_bytes, metadata, handle, staging_bytes
        )
    except OSError as e:
        raise naming_target(e, str(folder)) from e
    finally:
        if own:
            handle.close()
    generation = new_generation()
    index_temporary = folder / f"{tag}-index" if len(shards) > 1 else None
    try:
        if index_temporary is not None:
            names = shard_names(prefix, len(shards), generation)
            weight_map = {name: final for shard, final in zip(shards, names) for name in shard.entries}
            write_index(index_temporary, weight_map, sum(shard.data_bytes for shard in shards), generation)
        return commit(folder, prefix, [shard.path for shard in shards], index_temporary, generation)
    except BaseException as e:
        for path in [shard.path for shard in shards] + [index_temporary]:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if isinstance(e, OSError) and not isinstance(e, TimeoutError):  # (a lock wait's names the folder already)
            raise naming_target(e, str(folder)) from e
        raise


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    handle: AsyncIOHandle | None = None,
) -> Path:
    """Write the mapping ``tensors`` into the one safetensors file ``path`` (replaced only once complete).

    Args:
        tensors: Name -> tensor.
        path: The file to write; its folder must exist.
        metadata: Strings that go into the header (default ``{"format": "pt"}``, which transformers needs).
        handle: An ``AsyncIOHandle`` to write with (default: one made and closed here).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError: When ``tensors`` is not a mapping or holds something other than a tensor.
        FileNotFoundError: When ``path``'s folder does not exist.
        OSError: When writing fails (the errno of the failure; the message names ``path``).

    Examples:
        >>> import torch
        >>> from deepoffload.formats import load_file, save_file
        >>> str(save_file({"weight": torch.eye(2)}, "model.safetensors", metadata={"step": "10"}))
        'model.safetensors'
        >>> load_file("model.safetensors")
        {'weight': tensor([[1., 0.], [0., 1.]])}
    """  # noqa: DOC501, DOC502 -- ruff takes naming_target(...) for an exception class; it returns the OSError
    if not isinstance(tensors, Mapping):
        raise TypeError("save_file takes a mapping of name -> tensor; to stream an iterator use save_sharded")
    path = Path(path)
    check_little_endian()
    metadata = _checked_metadata(metadata)
    if not path.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"cannot save {path}: its folder {path.parent} does not exist", str(path))
    layout, position = {}, 0
    for name, tensor in tensors.items():  # the exact header, so the one file never needs a second shard
        _check(name, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        layout[name] = (tensor.dtype, tuple(tensor.shape), position, position + nbytes)
        position += nbytes
    header_bytes = -(-len(encode_header(layout, metadata)) // PAGE) * PAGE
    own = handle is None
    if handle is None:
        handle = AsyncIOHandle()
    remove_dead_temporaries(path.parent, path.name)
    try:
        tag = temporary_name(path.name)
        (shard,) = _write_shards(
            _items(tensors), path.parent, tag, float("inf"), header_bytes, metadata, handle, 16 << 20
        )
    except OSError as e:
        raise naming_target(e, str(path)) from e
    finally:
        if own:
            handle.close()
    try:
        adopt_mode(shard.path, path)
        os.replace(shard.path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            shard.path.unlink()
        raise
    sync_folder(path.parent)
    return path
