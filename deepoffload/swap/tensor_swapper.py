"""``TensorSwapper``: move named groups of tensors to files in a per-run folder and back, asynchronously.

Transfers go through a bounded pool of aligned staging buffers. Each group is one file, or (``packed=True``, see
``packed.py``) the groups of one ``swap_out`` call share one extent of a single pack file, written with one request,
and groups read together from adjacent extents come back in one request (many small tensors then cost a few large
transfers, not a file each; packed tensors are 16-byte aligned, and a read of one whole extent into the buffer it was
last read into hands back the same view objects, which cost microseconds each to make). Records, helpers, staging and
transfers in flight live in ``records.py``, ``staging_buffers.py`` and ``transfers.py``. Each tensor keeps a
``SwapRecord`` (key, dtype, shape, bytes, file, offset, ...) and is read back sized from its own record. Tensors are
staged through a pooled buffer (a copy, so any strides, dtype or device work; the copy is skipped when the tensor
already sits in the staging buffer where it will be written, as tensors returned by ``swap_in`` do). A group's previous
records stay valid until its new write has completed; a failed write drops them (the file is unknown now) and the caller
keeps its tensors.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
from typing import Any, Callable, Iterable, Mapping, cast

import torch

from ..errors import ChecksumError, ClosedError, UnsupportedError
from ..io.handle import AsyncIOHandle
from .codecs import ByteCodec, codec_class
from .config import SwapConfig
from .layouts import layout_class
from .packed import PACKED_ALIGNMENT, Extent, PackedLayout, PackFile
from .pool import PAGE_SIZE, BufferPool, round_up
from .records import TENSOR_ALIGNMENT, SwapRecord, _checked, _group_span, _hash, _identity, _local
from .staging_buffers import _StagingBuffers
from .transfers import Decode, SwapIn, SwapOut

__all__ = [
    "ChecksumError",
    "Groups",
    "PACKED_ALIGNMENT",
    "SwapIn",
    "SwapOut",
    "SwapRecord",
    "TENSOR_ALIGNMENT",
    "TensorSwapper",
]

Groups = Mapping[str, Mapping[str, torch.Tensor]]


class TensorSwapper(_StagingBuffers):
    """Swaps named groups of tensors to files in its own run folder.

    The run folder is rank-aware, and removed on ``close`` and at exit unless ``config.keep_files`` (a swapper
    dropped without ``close`` removes it then). One group is one file ``<folder>/<group>.swp``; group names are file
    names (letters, digits, ``-``, ``_``, ``.``). Usable as a context manager (``close`` on exit).

    Args:
        config: Where and how to swap (default: ``SwapConfig()``).
        rank: The process's rank, part of the run folder's name (None: taken from the environment).
        packed: All groups live in ``<folder>/pack.swp`` instead, one page-aligned extent per ``swap_out`` call
            (rewritten in place when the same groups come back with the same sizes; else written to free space, the
            old extent freed once the new write is done).

    Examples:
        >>> import torch
        >>> from deepoffload import SwapConfig, TensorSwapper
        >>> swapper = TensorSwapper(SwapConfig(folder=".", chunk_bytes=1 << 20, pin=False))
        >>> swapper.swap_out({"layer0": {"weight": torch.ones(4, 4), "bias": torch.zeros(4)}}).wait()
        4096
        >>> swapper.groups(), swapper.stored_bytes("layer0")
        (['layer0'], 80)
        >>> read = swapper.swap_in(["layer0"])
        >>> read.wait()["layer0"]["weight"].sum().item()
        16.0
        >>> read.release()
        >>> swapper.close()
    """

    def __init__(self, config: SwapConfig | None = None, *, rank: int | None = None, packed: bool = False):
        self.config = config or SwapConfig()
        if self.config.trust_folder_owner:  # others may change the files: changed bytes are then an error
            self.config = self.config.replace(checksum=True)
        if self.config.checksum:
            _hash(torch.zeros(1, dtype=torch.uint8))  # a missing xxhash fails here, not in the middle of a swap
        codec = codec_class(self.config.codec)()
        if packed and not codec.identity:
            raise UnsupportedError(
                f"TensorSwapper: codec={self.config.codec!r} with packed=True (the layout OffloadedOptimizer uses): "
                f"a packed extent is rewritten in place, which encoded bytes of another length cannot be; use "
                f"codec='none' there, or packed=False"
            )
        self._encoder: ByteCodec | None = None if codec.identity else codec  # None: bytes stored as they are
        self._codecs: dict[str, ByteCodec] = {codec.name: codec}  # name -> codec, for records written with it
        self.layout = layout_class(self.config.layout)(self.config, rank)  # where records live; makes the run folder
        self.folder = self.layout.folder
        self.handle = AsyncIOHandle(self.config.aio)
        self.pool = BufferPool(self.config.buffer_count, self.config.chunk_bytes, self.config.pin)
        self._records: dict[str, dict[str, SwapRecord]] = {}
        self._writing: dict[str, SwapOut] = {}
        self._reading: dict[str, SwapIn] = {}
        self._pending_out: collections.deque[SwapOut] = collections.deque()
        self.pack = PackFile(self.layout.pack_file()) if packed else None
        self._extents: dict[str, Extent] = {}  # packed: group -> the extent its current records point into
        self._packed = PackedLayout(self, self.pack) if self.pack is not None else None
        self._mapped: dict[str, tuple] = {}  # groups served read-only from other files -> the file's identity
        self.tensor_alignment = PACKED_ALIGNMENT if packed else TENSOR_ALIGNMENT  # between a group's tensors
        self._group_alignment = PACKED_ALIGNMENT if packed else PAGE_SIZE  # where each group starts in a buffer
        self.version = 0  # changes whenever a group's records change in size or place (not on in-place rewrites)
        self.bytes_read = 0
        self.bytes_written = 0
        self._closed = False
        self._created: set[str] = set()  # swap files made (0600) so far
        if self.pack is not None:
            self.layout.create_file(self.pack.path)

    # -- queries ------------------------------------------------------------------------------------------
    def records(self, group: str) -> Mapping[str, SwapRecord]:
        """The records of a group's tensors on storage (empty if none).

        Args:
            group: The group's name.

        Returns:
            A copy of ``{key: SwapRecord}``.
        """
        return dict(self._records.get(group, {}))

    def has(self, group: str) -> bool:
        """True when the group has records on storage.

        Args:
            group: The group's name.

        Returns:
            Whether ``group`` has at least one record on storage.
        """
        return bool(self._records.get(group))

    def groups(self) -> list[str]:
        """The names of the groups with records (on storage, or mapped from another file)."""
        return list(self._records)

    def stored_bytes(self, group: str | None = None) -> int:
        """Bytes of tensor data on storage, for one group or all.

        Args:
            group: The group to count (None: all groups).

        Returns:
            The tensors' bytes (without padding; 0 for a group with nothing on storage).
        """
        if group is not None:
            records = self._records.get(group)
            return sum(r.nbytes for r in records.values()) if records else 0
        return sum(r.nbytes for records in self._records.values() for r in records.values())

    def map_group(self, group: str, records: Mapping[str, SwapRecord]) -> None:
        """Serve ``group`` read-only from tensors that already lie in another file (a checkpoint).

        ``swap_in`` reads the range from the page holding the first byte to the last byte with one request, so a
        gap would be read too; only the unaligned tail is bounced. The staging buffer needs up to a page more than
        the tensors' bytes. ``swap_out`` of the group raises; ``discard`` forgets it and leaves the file alone. Each
        ``swap_in`` checks that the file is still the one mapped (same inode, size and modification time): a
        checkpoint replaced or rewritten since raises ``ChecksumError`` instead of serving other values. Raises
        ``ClosedError`` when the swapper is closed.

        Args:
            group: The group's name (letters, digits, ``-``, ``_``, ``.``).
            records: Where the tensors lie: one file, absolute byte offsets, each a multiple of its element size,
                laid out back to back, without checksums or DTensor shards.

        Raises:
            ValueError: When the group name is not a valid file name, the group is already on storage, or the
                records are not back to back in one file at offsets that are multiples of their element sizes (or
                carry checksums or DTensor shards).
        """
        self._check_open()
        self._check_group(group)
        records = dict(records)
        if group in self._records:
            raise ValueError(f"group {group!r} is already on storage")
        files = {r.file for r in records.values()}
        base = min((r.offset for r in records.values()), default=0)
        end = max((r.offset + r.nbytes for r in records.values()), default=0)
        if (
            len(files) != 1
            or end - base != sum(r.nbytes for r in records.values())
            or any(
                r.offset % r.dtype.itemsize or r.checksum is not None or r.dtensor is not None for r in records.values()
            )
        ):
            raise ValueError(
                f"group {group!r}: map_group needs tensors back to back in one file, each at an offset "
                f"that is a multiple of its element size, without checksums or DTensor shards"
            )
        identity = _identity(next(iter(files))) if files else ()
        self._records[group] = records
        self._mapped[group] = identity
        self.version += 1

    def mapped(self, group: str) -> bool:
        """True when ``group`` is served read-only from another file (``map_group``).

        Args:
            group: The group's name.

        Returns:
            Whether ``group`` is mapped.
        """
        return group in self._mapped

    def _check_mapped(self, group: str, records: Mapping[str, SwapRecord]) -> None:
        file = next(iter(records.values())).file
        try:
            same = _identity(file) == self._mapped[group]
        except FileNotFoundError:
            same = False
        if not same:
            raise ChecksumError(
                errno.EIO,
                f"group {group!r} is served from {file}, which was replaced, rewritten or "
                f"removed since it was mapped: its values may differ from those checked "
                f"then; map it (offload_parameters) again",
                file,
            )

    # -- transfers ------------------------------------------------------------------------------------------
    def swap_out(
        self, groups: Groups, on_done: Callable[[], None] | None = None, staged: SwapIn | None = None
    ) -> SwapOut:
        """Start writing each group's tensors to its file; keep the tensors until the write is done.

        The group's previous records stay valid until the new write has completed; a failed write drops them and
        the caller keeps its tensors. Raises ``ClosedError`` when the swapper is closed and ``ValueError`` when a
        group name is not a valid file name or a tensor cannot be swapped.

        Args:
            groups: ``{group: {key: tensor}}`` to write (any strides, dtype or device; staged through a copy).
            on_done: Runs once all are written, before any staging buffer is reused: drop your references to the
                tensors there.
            staged: The ``SwapIn`` these tensors came from; its buffer is written from directly when they all still
                sit where they were read (no copy), and is released once the write is done.

        Returns:
            The write in flight; its ``wait()`` returns the bytes written.

        Raises:
            PermissionError: When a group is served read-only from another file (``map_group``).
        """
        self._check_open()
        if staged is not None and self._packed is not None:
            write = self._packed.rewrite(groups, staged, on_done)
            if write is not None:
                return write
        layout: dict[str, dict[str, tuple[torch.Tensor, Any, int]]] = {}
        total = 0
        for group, tensors in groups.items():
            self._check_group(group)
            if group in self._mapped:
                file = next(iter(self._records[group].values())).file
                raise PermissionError(
                    errno.EACCES,
                    f"group {group!r} is served read-only from {file} (map_group): it cannot be written",
                    file,
                )
            self._wait_writing(group)
            if group in self._reading:  # its file is about to be rewritten: let the read finish first
                self._reading[group]._wait_io()
            offset, entries = 0, {}
            for key, tensor in tensors.items():
                local, spec = _local(_checked(group, key, tensor))
                entries[key] = (local, spec, offset)
                offset = round_up(offset + local.numel() * local.element_size(), self.tensor_alignment)
            layout[group] = entries
            total += round_up(offset, self._group_alignment)
        retired = staged._hand_over() if staged is not None else None
        if self.pack is not None:
            total = round_up(total)  # the extent: whole pages
        if retired is not None and self._in_place(layout, retired, self._group_alignment):
            buffer, buffers = retired, [retired]
        else:
            buffer = self._acquire(total)
            buffers = [buffer] + ([retired] if retired is not None else [])
        if self._packed is not None:
            return self._packed.swap_out(groups, layout, buffer, buffers, on_done)
        requests, records, start, shifts = [], {}, 0, {}
        for group, entries in layout.items():
            file = self.layout.group_file(group)
            group_records, span = self._stage(group, entries, buffer, start, file, 0)
            if file not in self._created:
                self.layout.create_file(file)  # 0600, before the op opens it (the op would create it 0644 & ~umask)
                self._created.add(file)
            if span and self._encoder is not None:
                stored, nbytes = self._encoded(self._encoder, buffer[start : start + span])
                name = self._encoder.name
                group_records = {k: dataclasses.replace(r, codec=name, stored=nbytes) for k, r in group_records.items()}
                requests.append(self.handle.write_async(stored, file))
            elif span:
                requests.append(self.handle.write_async(buffer[start : start + span], file))
            else:
                os.truncate(file, 0)
            records[group], shifts[group] = group_records, start
            start += span
        write = SwapOut(self, requests, records, buffers, tuple(groups.values()), on_done, shifts=shifts)
        for group in records:
            self._writing[group] = write
        self._pending_out.append(write)
        return write

    def write_back(self, staged: SwapIn, on_done: Callable[[], None] | None = None) -> SwapOut | None:
        """Write the buffer of a read of one whole extent back over that extent, keeping the records (packed only).

        For a caller that checked the tensors ``staged.wait()`` returned are still exactly the groups' tensors
        (changed in place only). Raises ``ClosedError`` when the swapper is closed.

        Args:
            staged: The read whose buffer is written back.
            on_done: As for ``swap_out``.

        Returns:
            The write in flight, or None (nothing done) when ``staged`` did not read a whole extent, or its groups
            live elsewhere now.
        """
        self._check_open()
        extent, packed = staged._extent, self._packed
        if (
            extent is None
            or packed is None
            or staged._buffer is None
            or self._extents.get(extent.names[0]) is not extent
            or len(extent.live) != len(extent.names)
            or list(staged._layout) != extent.names
        ):
            return None
        return packed.write_back(extent, staged, on_done, tuple(staged.wait().values()))

    def swap_in(self, groups: Iterable[str]) -> SwapIn:
        """Start reading the named groups back, each sized from its records.

        Groups read together from adjacent places in one file come back with one request. Raises ``ClosedError``
        when the swapper is closed, and ``ChecksumError`` when a group mapped from another file (``map_group``) finds
        that file replaced, rewritten or removed since.

        Args:
            groups: The names of the groups to read; groups with nothing on storage come back empty.

        Returns:
            The read in flight; its ``wait()`` returns ``{group: {key: tensor}}``.
        """
        self._check_open()
        groups = list(groups)
        if self._writing:
            for group in groups:
                self._wait_writing(group)
        packed = self._packed
        whole = packed.whole_extent(groups) if packed is not None else None
        if packed is not None and whole is not None:
            return packed.read_extent(groups, whole)
        layout, total = {}, 0
        spans: list[tuple[str, int, int, int]] = []  # (file, offset in it, start in the buffer, length) to read
        encoded: list[tuple[SwapRecord, int, int]] = []  # (a record of an encoded group, start in the buffer, span)
        for group in groups:
            self._wait_writing(group)
            records = self._records.get(group, {})
            extent = self._extents.get(group)
            if extent is not None:  # packed: records hold file offsets; the group starts at ``base``
                begin, span = extent.members[group]
                base = extent.offset + begin
                length = span
            elif group in self._mapped and records:  # another file's range, from its first tensor to its last,
                self._check_mapped(group, records)
                # from the page holding its first byte: file and buffer then share their alignment (direct reads)
                base = min(r.offset for r in records.values()) // PAGE_SIZE * PAGE_SIZE
                length = max(r.offset + r.nbytes for r in records.values()) - base  # exactly: not past its end
                span = round_up(length)
            else:
                span, base = _group_span(records.values()), 0
                length = span
                first = next(iter(records.values()), None)
                if span and first is not None and first.codec != "none":  # read its stored bytes, decode at wait
                    encoded.append((first, total, span))
                    layout[group] = (total, records)
                    total += span
                    continue
            layout[group] = (total - base, records)  # buffer position of a tensor: this + its record's offset
            if span:
                file = next(iter(records.values())).file
                if (
                    spans
                    and spans[-1][0] == file
                    and spans[-1][1] + spans[-1][3] == base
                    and spans[-1][2] + spans[-1][3] == total
                ):  # adjacent on storage and in the buffer:
                    spans[-1] = (*spans[-1][:3], spans[-1][3] + length)  # one request
                else:
                    spans.append((file, base, total, length))
            total += span
        buffer = self._acquire(total) if total else None
        requests = (
            [self.handle.read_async(buffer[start : start + span], file, offset) for file, offset, start, span in spans]
            if buffer is not None
            else []
        )  # (no spans without bytes)
        decodes = []
        for record, start, span in encoded:  # (buffer is set: encoded groups have bytes)
            stored = self.pool.one_off(record.stored)
            requests.append(self.handle.read_async(stored[: round_up(record.stored)], record.file))
            codec = self._codecs.get(record.codec) or self._codecs.setdefault(record.codec, codec_class(record.codec)())
            decodes.append(
                Decode(codec, stored[: record.stored], cast(torch.Tensor, buffer)[start : start + span], record.file)
            )
        read = SwapIn(self, requests, layout, buffer, decodes=decodes)
        for group in layout:
            self._reading[group] = read
        return read

    def discard(self, group: str) -> None:
        """Forget a group and delete its file (packed: free its part of its extent).

        A group mapped from another file (``map_group``) is forgotten and its file left alone. Waits first for a
        write of the group in flight, and for a read of it.

        Args:
            group: The group's name (unknown groups are ignored).
        """
        self._wait_writing(group)
        if group in self._reading:  # its bytes may be reused: let the read finish first
            self._reading[group]._wait_io()
        records = self._records.pop(group, None)
        if records is not None:
            self.version += 1
        extent = self._extents.pop(group, None)
        if extent is not None:
            extent.leave(group)
        elif group in self._mapped:
            del self._mapped[group]  # the file is someone else's
        elif records:
            self.layout.remove_file(next(iter(records.values())).file)

    def wait_all(self) -> None:
        """Wait for every write in flight; raise the first failure (an ``OSError``) after all have finished."""
        error = None
        while self._pending_out:
            try:
                self._pending_out[0].wait()
            except OSError as e:
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish the writes in flight, stop the IO threads and remove the run folder (unless kept)."""
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            self._closed = True
            self.handle.close()
            self.layout.close()  # (a kept one stays)

    def __enter__(self) -> "TensorSwapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this TensorSwapper is closed")
        self.layout.check()  # a run folder replaced by a link to someone else's: nothing more moves

    @staticmethod
    def _check_group(group: str) -> None:
        if (
            not isinstance(group, str)
            or not group
            or not all(c.isalnum() or c in "-_." for c in group)
            or group.startswith(".")
        ):
            raise ValueError(f"group name {group!r}: use letters, digits, '-', '_' and '.' (it names a file)")

    def _wait_writing(self, group: str) -> None:
        write = self._writing.get(group)
        if write is not None:
            write.wait()
