"""``TensorSwapper``: move named groups of tensors to files of this run and back, asynchronously.

Each tensor keeps a ``SwapRecord`` (key, dtype, shape, bytes, file, offset, codec, ...) and is read back sized from
its own record. Tensors are staged through a pooled buffer (``staging_buffers.py``: a copy, so any strides, dtype or
device work; skipped when the tensor already sits where it will be written, as tensors ``swap_in`` returned do).
Each group is one file named by the storage layout (``layouts/``), stored through the byte codec (``codecs/``), or
(``packed=True``, ``packed.py``) the groups of one ``swap_out`` call share one extent of one pack file, written with
one request. Reads are planned in ``read_plan.py``, transfers in flight are ``transfers.py``'s, groups served from a
checkpoint ``mapped.py``'s. A group's previous records stay valid until its new write has completed; a failed write
drops them (the file is unknown now) and the caller keeps its tensors.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Mapping, cast

import torch

from ..errors import ChecksumError, ClosedError, UnsupportedError
from .codecs import ByteCodec, codec_class
from .config import SwapConfig
from .drive_handles import DriveHandles
from .extents import PackFile
from .layouts import layout_class
from .mapped import MappedFiles
from .packed import PACKED_ALIGNMENT, Groups, PackedLayout
from .pool import PAGE_SIZE, BufferPool, round_up
from .read_plan import ReadPlan
from .records import TENSOR_ALIGNMENT, SwapRecord, check_group_name, checked_tensor, hash_bytes, local_shard
from .staging_buffers import StagingBuffers
from .transfers import Decode, SwapIn, SwapOut

if TYPE_CHECKING:
    from .extents import Extent

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


class TensorSwapper:
    """Swaps named groups of tensors to files in its own run folder (its storage layout's, ``config.layout``).

    The run folder is rank-aware, and removed on ``close`` and at exit unless ``config.keep_files`` (a swapper
    dropped without ``close`` removes it then). With the ``folder`` layout one group is one file
    ``<folder>/<group>.swp``; group names are file names (letters, digits, ``-``, ``_``, ``.``). A context manager.

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
            hash_bytes(torch.zeros(1, dtype=torch.uint8))  # a missing xxhash fails here, not in the middle of a swap
        codec = codec_class(self.config.codec)()
        if packed and not codec.identity:
            raise UnsupportedError(
                f"TensorSwapper: codec={self.config.codec!r} with packed=True (OffloadedOptimizer's layout): a packed "
                f"extent is rewritten in place, which encoded bytes of another length cannot be; give the optimizer "
                f"config.replace(codec='none') (offload_parameters does so itself), or use TensorSwapper(packed=False)"
            )
        self._encoder: ByteCodec | None = None if codec.identity else codec  # None: bytes stored as they are
        self._codecs: dict[str, ByteCodec] = {codec.name: codec}  # name -> codec, for records written with it
        self.layout = layout_class(self.config.layout)(self.config, rank)  # where records live; makes the run folder
        self.folder = self.layout.folder
        self.io = DriveHandles(self.layout, self.config.aio)  # one handle (queue, threads) per drive
        self.handle = self.io.handles[0]
        self._records: dict[str, dict[str, SwapRecord]] = {}
        self._writing: dict[str, SwapOut] = {}
        self._reading: dict[str, SwapIn] = {}
        self._pending_out: collections.deque[SwapOut] = collections.deque()
        packs = [PackFile(path) for path in self.layout.pack_files()] if packed else []
        self.pack = packs[0] if packs else None  # (the first pack file: the only one of the folder layout)
        self.packing = PackedLayout(self, packs, self.layout.pack_weights()) if packs else None  # its extents
        self.mapped_files = MappedFiles()  # groups served read-only from other files
        self.tensor_alignment = PACKED_ALIGNMENT if packed else TENSOR_ALIGNMENT  # between a group's tensors
        self.checksum = self.config.checksum
        self.staging = StagingBuffers(
            BufferPool(self.config.buffer_count, self.config.chunk_bytes, self.config.pin),
            self._pending_out,
            self.checksum,
            PACKED_ALIGNMENT if packed else PAGE_SIZE,  # where each group starts in a buffer
            self.packing.forget_views if self.packing is not None else None,
        )
        self.pool = self.staging.pool
        self.version = 0  # changes whenever a group's records change in size or place (not on in-place rewrites)
        self.bytes_read = 0
        self.bytes_written = 0
        self._closed = False
        self._created: set[str] = set()  # swap files made (0600) so far
        for pack in packs:
            self.layout.create_file(pack.path)

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
            return sum(r.nbytes for r in self._records.get(group, {}).values())
        return sum(r.nbytes for records in self._records.values() for r in records.values())

    def map_group(self, group: str, records: Mapping[str, SwapRecord], encoded: bool = False) -> None:
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
            encoded: ``records`` are a codec's file laid out as a swap file (a checkpoint's compressed copy).

        Raises:
            ValueError: When the group name is not a valid file name, the group is already on storage, or the
                records are not back to back in one file at offsets that are multiples of their element sizes (or
                carry checksums or DTensor shards).
        """
        self._check_open()
        check_group_name(group)
        if group in self._records:
            raise ValueError(f"group {group!r} is already on storage")
        self.mapped_files.add(group, records := dict(records), encoded)
        self._records[group] = records
        self.version += 1

    def mapped(self, group: str) -> bool:
        """True when ``group`` is served read-only from another file (``map_group``).

        Args:
            group: The group's name.

        Returns:
            Whether ``group`` is mapped.
        """
        return group in self.mapped_files

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
        if staged is not None and self.packing is not None:
            write = self.packing.rewrite(groups, staged, on_done)
            if write is not None:
                return write
        layout: dict[str, dict[str, tuple[torch.Tensor, Any, int]]] = {}
        total = 0
        for group, tensors in groups.items():
            check_group_name(group)
            self.mapped_files.refuse_write(group, self._records.get(group, {}))
            self.wait_writing(group)
            if group in self._reading:  # its file is about to be rewritten: let the read finish first
                self._reading[group].wait_io()
            offset, entries = 0, {}
            for key, tensor in tensors.items():
                local, spec = local_shard(checked_tensor(group, key, tensor))
                entries[key] = (local, spec, offset)
                offset = round_up(offset + local.numel() * local.element_size(), self.tensor_alignment)
            layout[group] = entries
            total += round_up(offset, self.staging.group_alignment)
        retired = staged.hand_over() if staged is not None else None
        if self.pack is not None:
            total = round_up(total)  # the extent: whole pages
        if retired is not None and StagingBuffers.in_place(layout, retired, self.staging.group_alignment):
            buffer, buffers = retired, [retired]
        else:
            buffer = self.staging.acquire(total)
            buffers = [buffer] + ([retired] if retired is not None else [])
        if self.packing is not None:
            return self.packing.swap_out(groups, layout, buffer, buffers, on_done)
        requests, records, start, shifts = [], {}, 0, {}
        for group, entries in layout.items():
            file = self.layout.group_file(group)
            group_records, span = self.staging.stage(group, entries, buffer, start, file, 0)
            if file not in self._created:
                self.layout.create_file(file)  # 0600, before the op opens it (the op would create it 0644 & ~umask)
                self._created.add(file)
            if span and self._encoder is not None:
                stored, nbytes = self.staging.encoded(self._encoder, buffer[start : start + span])
                name = self._encoder.name
                group_records = {k: dataclasses.replace(r, codec=name, stored=nbytes) for k, r in group_records.items()}
                requests.append(self.io.of(file).write_async(stored, file))
            elif span:
                requests.append(self.io.of(file).write_async(buffer[start : start + span], file))
            else:
                os.truncate(file, 0)
            records[group], shifts[group] = group_records, start
            start += span
        write = SwapOut(self, requests, records, buffers, tuple(groups.values()), on_done, shifts=shifts)
        self.track_write(write, records)
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
        return self.packing.write_back_read(staged, on_done) if self.packing is not None else None

    def swap_in(self, groups: Iterable[str], skip: Mapping[str, Collection[str]] | None = None) -> SwapIn:
        """Start reading the named groups back, each sized from its records.

        Groups read together from adjacent places in one file come back with one request. Raises ``ClosedError``
        when the swapper is closed, and ``ChecksumError`` when a group mapped from another file (``map_group``) finds
        that file replaced, rewritten or removed since.

        Args:
            groups: The names of the groups to read; groups with nothing on storage come back empty.
            skip: Group -> keys of it left unread (not in the result; a packed swapper reads them anyway).

        Returns:
            The read in flight; its ``wait()`` returns ``{group: {key: tensor}}``.
        """
        self._check_open()
        groups = list(groups)
        if self._writing:
            for group in groups:
                self.wait_writing(group)
        packed = self.packing
        whole = packed.whole_extent(groups) if packed is not None else None
        if packed is not None and whole is not None:
            return packed.read_extent(groups, whole)
        plan = ReadPlan()
        for group in groups:
            self.wait_writing(group)
            records = self._records.get(group, {})
            mapped = bool(records) and group in self.mapped_files
            if mapped:
                self.mapped_files.check(group, records)
                mapped = self.mapped_files.raw(group)
            left_out = (skip or {}).get(group, ()) if packed is None else ()
            plan.add(group, records, packed.span(group) if packed is not None else None, mapped, left_out)
        total, spans, layout = plan.total, plan.spans, plan.layout
        buffer = self.staging.acquire(total) if total else None
        requests = (
            [self.io.of(f).read_async(buffer[start : start + span], f, offset) for f, offset, start, span in spans]
            if buffer is not None
            else []
        )  # (no spans without bytes)
        decodes = []
        for record, start, span in plan.encoded:  # (buffer is set: encoded groups have bytes)
            stored, out = self.pool.one_off(record.stored), cast(torch.Tensor, buffer)[start : start + span]
            requests.append(self.io.of(record.file).read_async(stored[: round_up(record.stored)], record.file))
            codec = self._codecs.setdefault(record.codec, codec_class(record.codec)())
            decodes.append(Decode(codec, stored[: record.stored], out, record.file, requests[-1]))
        read = SwapIn(self, requests, layout, buffer, decodes=decodes)
        self.track_read(read, layout)
        return read

    def discard(self, group: str) -> None:
        """Forget a group and delete its file (packed: free its part of its extent).

        A group mapped from another file (``map_group``) is forgotten and its file left alone. Waits first for a
        write of the group in flight, and for a read of it.

        Args:
            group: The group's name (unknown groups are ignored).
        """
        self.wait_writing(group)
        if group in self._reading:  # its bytes may be reused: let the read finish first
            self._reading[group].wait_io()
        records = self._records.pop(group, None)
        if records is not None:
            self.version += 1
        if self.packing is not None and self.packing.leave(group):
            pass  # (its extent is freed once no group lives there)
        elif self.mapped_files.forget(group):
            pass  # the file is someone else's
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
            self.io.close()
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

    # -- what transfers and the packed layout hand back (inside the package) ---------------------------------
    def wait_writing(self, group: str) -> None:
        """Wait for a write of ``group`` in flight, if any (its error is raised).

        Args:
            group: The group's name.
        """
        write = self._writing.get(group)
        if write is not None:
            write.wait()

    def current_records(self, group: str) -> dict[str, SwapRecord]:
        """The group's records in force: this swapper's own dict, to read and never change (see ``records``).

        Args:
            group: The group's name.

        Returns:
            ``{key: SwapRecord}`` (empty for an unknown group).
        """
        return self._records.get(group, {})

    def track_write(self, write: SwapOut, groups: Iterable[str]) -> None:
        """``write`` is in flight for ``groups``: later transfers of them wait for it.

        Args:
            write: The write.
            groups: Its groups.
        """
        for group in groups:
            self._writing[group] = write
        self._pending_out.append(write)

    def track_read(self, read: SwapIn, groups: Iterable[str]) -> None:
        """``read`` is in flight for ``groups``: a rewrite or discard of them lets it finish first.

        Args:
            read: The read.
            groups: Its groups.
        """
        for group in groups:
            self._reading[group] = read

    def settle_write(
        self,
        write: SwapOut,
        records: dict[str, dict[str, SwapRecord]],
        extent: Extent | None,
        rewrite: bool,
        ok: bool,
        nbytes: int,
    ) -> None:
        """Put a finished write's records in force, or drop its groups' records when it failed (bytes unknown).

        Args:
            write: The write.
            records: ``{group: {key: SwapRecord}}`` it wrote.
            extent: Packed: where they were written.
            rewrite: The groups' records stay as they were (same sizes, same place).
            ok: Whether every request succeeded.
            nbytes: The bytes written.
        """
        for group in records:
            if self._writing.get(group) is write:
                del self._writing[group]
        # packed (an extent means a packed swapper): a rewrite in place that worked moves nothing
        if (not ok or not rewrite) and extent is not None and self.packing is not None:
            self.packing.settle(list(records), extent, ok)
        if not ok or not rewrite:
            self.version += 1
        if ok:
            self._records.update(records)
            self.bytes_written += nbytes
        else:
            for group in records:
                self._records.pop(group, None)

    def forget_write(self, write: SwapOut) -> None:
        """``write`` has finished and handed back its buffers.

        Args:
            write: The write.
        """
        if write in self._pending_out:
            self._pending_out.remove(write)

    def read_done(self, read: SwapIn, groups: Iterable[str], nbytes: int) -> None:
        """The reads of ``groups`` by ``read`` have finished.

        Args:
            read: The read.
            groups: Its groups.
            nbytes: The bytes read (0 when they failed).
        """
        self.bytes_read += nbytes
        for group in groups:
            if self._reading.get(group) is read:
                del self._reading[group]
