"""``TensorSwapper``: move named groups of tensors to files in a per-run folder and back, asynchronously, through a
bounded pool of aligned staging buffers.

Each group is one file, or (``packed=True``) the groups of one ``swap_out`` call share one extent of a single
pack file, written with one request, and groups read together from adjacent extents come back in one request (many
small tensors then cost a few large transfers, not a file each; packed tensors are 16-byte aligned, and a read of one
whole extent into the buffer it was last read into hands back the same view objects, which cost microseconds each to
make). Each tensor keeps a ``SwapRecord`` (key, dtype, shape, bytes, file, offset, ...) and is read back sized from its
own record. Tensors are staged through a pooled buffer (a copy, so any strides, dtype or device work; the copy is
skipped when the tensor already sits in the staging buffer where it will be written, as tensors returned by ``swap_in``
do). A group's previous records stay valid until its new write has completed; a failed write drops them (the file is
unknown now) and the caller keeps its tensors.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import os
import weakref
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from ..errors import ChecksumError, ClosedError
from ..io.handle import AsyncIOHandle, Request
from .config import SwapConfig
from .extents import Extent, PackFile
from .folders import create_run_folder, keep_run_folder, remove_run_folder, remove_run_folder_if_owned
from .pool import PAGE_SIZE, BufferPool, round_up

Groups = Mapping[str, Mapping[str, torch.Tensor]]
TENSOR_ALIGNMENT = 64  # bytes between tensors of a group; a group's file and buffer region are page-aligned
PACKED_ALIGNMENT = 16  # packed: bytes between tensors and between groups (any dtype's item size divides it), so
# many small tensors (e.g. Adam's 4-byte ``step``) do not each cost a cache line on storage


def _identity(path: str) -> tuple[int, int, int, int]:
    """What tells a file apart from a replacement or a rewrite: device, inode, size, modification time (ns)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class SwapRecord:
    """Where one swapped tensor lives and what it is.

    nbytes: the tensor's bytes (numel * element size). offset: its byte offset in ``file`` (a multiple of
    ``TENSOR_ALIGNMENT``, or of ``PACKED_ALIGNMENT`` in a pack file; any offset in a file served by ``map_group``).
    device: where it is restored. checksum: xxh3-64 of its bytes, or None. dtensor: (device mesh, placements,
    global shape, global stride) when the tensor was a DTensor (its local shard is what is stored), else None.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: str
    offset: int
    device: torch.device
    checksum: int | None = None
    dtensor: tuple | None = None


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """A DTensor's local shard and its (mesh, placements, shape, stride); other tensors as they are."""
    if hasattr(tensor, "to_local") and hasattr(tensor, "placements"):
        return tensor.to_local(), (tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape), tensor.stride())
    return tensor, None


def _checked(group: str, key: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"swap_out: {group}/{key} is a {type(tensor).__name__}, not a tensor")
    if tensor.is_sparse or tensor.is_quantized:
        raise ValueError(f"swap_out: {group}/{key} is sparse or quantized and has no single byte buffer; swap "
                         f"tensor.to_dense() or tensor.dequantize() instead")
    return tensor


def _hash(region: torch.Tensor) -> int:
    """xxh3-64 of a contiguous CPU uint8 tensor's bytes, read in place (through ctypes, not numpy)."""
    try:
        import xxhash
    except ImportError as e:
        raise ImportError("checksum=True needs the xxhash package: pip install xxhash") from e
    if not region.numel():
        return 0
    return xxhash.xxh3_64_intdigest((ctypes.c_char * region.numel()).from_address(region.data_ptr()))


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _group_span(records: Iterable[SwapRecord]) -> int:
    """Bytes a group's file holds (the end of its last tensor, rounded up to the page size)."""
    return round_up(max((r.offset + r.nbytes for r in records), default=0))


class SwapOut:
    """Writes in flight for some groups. ``wait()`` returns the bytes written once the new records are in force
    and the staging buffer is released; on failure it raises the first ``OSError`` and the caller's tensors stay
    its own (nothing was freed)."""

    def __init__(self, swapper: "TensorSwapper", requests: list[Request], records: dict[str, dict[str, SwapRecord]],
                 buffers: list[torch.Tensor], sources: tuple, on_done: Callable[[], None] | None,
                 extent: Extent | None = None, rewrite: bool = False, shifts: dict[str, int] | None = None):
        self._swapper = swapper
        self._shifts = shifts or {}  # group -> its tensors' position in the staging buffer less their file offset
        self._rewrite = rewrite  # the groups' records stay as they are (same sizes, same place)
        self._extent = extent  # packed: where these groups are being written (new, or theirs rewritten in place)
        self._requests = requests
        self._records = records
        self._buffers = buffers  # the staging buffer written from, and the swap-in buffer it replaces, if any
        self._sources = sources  # the caller's tensors, alive until their bytes are written
        self._on_done = on_done
        self._result: int | BaseException | None = None

    def done(self) -> bool:
        return self._result is not None or all(r.done() for r in self._requests)

    def staged(self) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors being written, as views of the staging buffer the write reads from (CPU tensors that are not
        DTensors; others are left out), for a caller that frees its own tensors now rather than when the write is
        done: from here on this write no longer keeps the caller's tensors alive. The views hold the same bytes;
        they stay valid until ``on_done`` runs, and for good if the write fails (the buffer leaves the pool)."""
        if self._result is not None or not self._buffers or not self._shifts:
            return {}
        buffer, typed, views = self._buffers[0], {}, {}
        for group, records in self._records.items():
            shift = self._shifts[group]
            views[group] = {}
            for key, r in records.items():
                if r.device.type != "cpu" or r.dtensor is not None or not r.nbytes:
                    continue
                view = typed.get(r.dtype)
                if view is None:
                    view = typed[r.dtype] = buffer.view(r.dtype)
                views[group][key] = view.as_strided(r.shape, _contiguous_strides(r.shape),
                                                    view.storage_offset() + (r.offset + shift) // r.dtype.itemsize)
        self._sources = ()
        return views

    def wait(self) -> int:
        if self._result is None:
            self._finish()
        if isinstance(self._result, BaseException):
            raise self._result
        return self._result

    def _finish(self) -> None:
        swapper, error, nbytes = self._swapper, None, 0
        for request in self._requests:
            try:
                nbytes += request.wait()
            except OSError as e:
                error = error or e
        for group in self._records:
            if swapper._writing.get(group) is self:
                del swapper._writing[group]
        if error is not None or not self._rewrite:  # (a rewrite in place that worked moves nothing)
            swapper._settle_extents(list(self._records), self._extent, error is None)
        if error is not None or not self._rewrite:
            swapper.version += 1
        if error is None:
            swapper._records.update(self._records)
            swapper.bytes_written += nbytes
            if self._on_done is not None:
                self._on_done()
            for buffer in self._buffers:
                swapper.pool.release(buffer)
        else:
            for group in self._records:
                swapper._records.pop(group, None)
            for buffer in self._buffers:
                swapper._forget(buffer)  # views of it may stay resident in the caller's hands
        self._result = error if error is not None else nbytes
        self._requests, self._sources, self._buffers, self._on_done, self._extent = [], (), [], None, None
        if self in swapper._pending_out:
            swapper._pending_out.remove(self)


class SwapIn:
    """Reads in flight for some groups. ``wait()`` returns ``{group: {key: tensor}}``: views of one pooled buffer
    (CPU tensors) that stay valid until those groups are swapped out again or ``release()`` is called."""

    def __init__(self, swapper: "TensorSwapper", requests: list[Request], layout: dict[str, tuple[int, dict]],
                 buffer: torch.Tensor | None, extent: Extent | None = None):
        self._swapper = swapper
        self._extent = extent  # packed: the one extent read whole (its views may be reused), else None
        self._requests = requests
        self._layout = layout  # group -> (start in buffer, records)
        self._buffer = buffer
        self._tensors: dict[str, dict[str, torch.Tensor]] | None = None
        self._error: OSError | None = None

    def wait(self) -> dict[str, dict[str, torch.Tensor]]:
        if self._tensors is None:
            error = self._wait_io()
            if error is not None:
                self.release()
                raise error
            tensors = self._cached_views()
            if tensors is None:
                typed: dict = {}
                tensors = {group: {key: self._restore(start, record, typed) for key, record in records.items()}
                           for group, (start, records) in self._layout.items()}
                self._cache_views(tensors)
            self._tensors = tensors
        return self._tensors

    def _cached_views(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """The views made the last time this extent was read into this same buffer, when its records are still
        the same objects (the layout is unchanged): making a tensor costs microseconds, many small ones add up."""
        cached = self._extent.views if self._extent is not None else None
        if cached is None or cached[0] is not self._buffer or len(cached[1]) != len(self._layout):
            return None
        if not all(a is b[1] for a, b in zip(cached[1], self._layout.values())):
            return None
        return dict(cached[2])

    def _cache_views(self, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Keep ``tensors`` for the next read of this extent into this buffer, when they are plain CPU views of a
        pooled buffer and carry no checksum to verify."""
        swapper = self._swapper
        if self._extent is None or swapper.config.checksum or not swapper.pool.pooled(self._buffer):
            return
        records = [records for _, records in self._layout.values()]
        if all(r.device.type == "cpu" and r.dtensor is None and r.nbytes for rs in records for r in rs.values()):
            self._extent.views = (self._buffer, records, dict(tensors))

    def views_of_buffer(self, group: str, tensors: Mapping[str, torch.Tensor]) -> bool:
        """True when ``tensors`` are exactly the tensors ``wait()`` returned for ``group`` (the same objects, all
        CPU views of this read's buffer), so their bytes already sit where that group's file layout puts them."""
        mine = self._tensors.get(group) if self._tensors is not None and self._buffer is not None else None
        if mine is None or mine.keys() != tensors.keys():
            return False
        records = self._layout[group][1]
        return all(tensors[key] is value and records[key].dtensor is None and records[key].device.type == "cpu"
                   for key, value in mine.items())

    def _wait_io(self) -> OSError | None:
        """Finish the reads (the files may be rewritten after this); return the first error (kept for later)."""
        error, nbytes = self._error, 0
        for request in self._requests:
            try:
                nbytes += request.wait()
            except OSError as e:
                error = error or e
        self._requests = []
        self._error = error
        self._swapper.bytes_read += nbytes if error is None else 0
        for group in self._layout:
            if self._swapper._reading.get(group) is self:
                del self._swapper._reading[group]
        return error

    def _restore(self, start: int, record: SwapRecord, typed: dict) -> torch.Tensor:
        """The record's tensor as a view of the buffer (``typed``: the buffer viewed as each dtype, reused)."""
        if record.nbytes == 0:
            local = torch.empty(record.shape, dtype=record.dtype)
        else:
            position = start + record.offset
            if record.checksum is not None:
                region = self._buffer[position:position + record.nbytes]
                if _hash(region) != record.checksum:
                    self.release()
                    raise ChecksumError(errno.EIO, f"checksum mismatch for {record.key!r} ({record.nbytes} bytes at "
                                                   f"offset {record.offset}): the swap file was changed or corrupted",
                                        record.file)
            view = typed.get(record.dtype)
            if view is None:
                view = typed[record.dtype] = self._buffer.view(record.dtype)
            local = view.as_strided(record.shape, _contiguous_strides(record.shape),
                                    view.storage_offset() + position // record.dtype.itemsize)
        if record.device.type != "cpu":
            local = local.to(record.device)
        if record.dtensor is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = record.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def release(self) -> None:
        """Give the staging buffer back (after waiting for the reads); the tensors from ``wait()`` die with it."""
        self._wait_io()
        if self._buffer is not None:
            self._swapper.pool.release(self._buffer)
            self._buffer = None

    def detach(self) -> None:
        """The tensors from ``wait()`` stay in use indefinitely: the buffer leaves the pool (freed with them)."""
        buffer = self._hand_over()
        if buffer is not None:
            self._swapper._forget(buffer)

    def _hand_over(self) -> torch.Tensor | None:
        """Give up the staging buffer to a ``SwapOut`` that takes charge of it."""
        buffer, self._buffer = self._buffer, None
        return buffer


class TensorSwapper:
    """Swaps named groups of tensors to files in its own run folder (rank-aware; removed on ``close`` and at exit
    unless ``config.keep_files``). One group is one file ``<folder>/<group>.swp``; group names are file names
    (letters, digits, ``-``, ``_``, ``.``). ``packed``: all groups live in ``<folder>/pack.swp`` instead, one
    page-aligned extent per ``swap_out`` call (rewritten in place when the same groups come back with the same
    sizes; else written to free space, the old extent freed once the new write is done)."""

    def __init__(self, config: SwapConfig | None = None, *, rank: int | None = None, packed: bool = False):
        self.config = config or SwapConfig()
        if self.config.checksum:
            _hash(torch.zeros(1, dtype=torch.uint8))  # a missing xxhash fails here, not in the middle of a swap
        self.folder = create_run_folder(self.config.folder, rank)
        if self.config.keep_files:
            keep_run_folder(self.folder)
        # Dropped without close(): its files go with it, not at exit (a loop making optimizers would fill the disk).
        weakref.finalize(self, remove_run_folder_if_owned, self.folder).atexit = False
        self.handle = AsyncIOHandle(self.config.aio)
        self.pool = BufferPool(self.config.buffer_count, self.config.chunk_bytes, self.config.pin)
        self._records: dict[str, dict[str, SwapRecord]] = {}
        self._writing: dict[str, SwapOut] = {}
        self._reading: dict[str, SwapIn] = {}
        self._pending_out: collections.deque[SwapOut] = collections.deque()
        self.pack = PackFile(os.path.join(self.folder, "pack.swp")) if packed else None
        self._extents: dict[str, Extent] = {}  # packed: group -> the extent its current records point into
        self._mapped: dict[str, tuple] = {}  # groups served read-only from other files -> the file's identity
        self.tensor_alignment = PACKED_ALIGNMENT if packed else TENSOR_ALIGNMENT  # between a group's tensors
        self._group_alignment = PACKED_ALIGNMENT if packed else PAGE_SIZE  # where each group starts in a buffer
        self.version = 0  # changes whenever a group's records change in size or place (not on in-place rewrites)
        self.bytes_read = 0
        self.bytes_written = 0
        self._closed = False

    # -- queries ------------------------------------------------------------------------------------------
    def records(self, group: str) -> Mapping[str, SwapRecord]:
        """The records of a group's tensors on storage (empty if none)."""
        return dict(self._records.get(group, {}))

    def has(self, group: str) -> bool:
        """True when the group has records on storage."""
        return bool(self._records.get(group))

    def groups(self) -> list[str]:
        return list(self._records)

    def stored_bytes(self, group: str | None = None) -> int:
        """Bytes of tensor data on storage, for one group or all."""
        if group is not None:
            records = self._records.get(group)
            return sum(r.nbytes for r in records.values()) if records else 0
        return sum(r.nbytes for records in self._records.values() for r in records.values())

    def map_group(self, group: str, records: Mapping[str, SwapRecord]) -> None:
        """Serve ``group`` read-only from tensors that already lie in another file (a checkpoint): ``records`` say
        where (one file, absolute byte offsets, each a multiple of its element size), laid out back to back
        (``swap_in`` reads the range from the page holding the first byte to the last byte with one request, so a
        gap would be read too; only the unaligned tail is bounced). The staging buffer needs up to a page more than
        the tensors' bytes.
        ``swap_out`` of the group raises; ``discard`` forgets it and leaves the file alone. Each ``swap_in`` checks
        that the file is still the one mapped (same inode, size and modification time): a checkpoint replaced or
        rewritten since raises ``ChecksumError`` instead of serving other values."""
        self._check_open()
        self._check_group(group)
        records = dict(records)
        if group in self._records:
            raise ValueError(f"group {group!r} is already on storage")
        files = {r.file for r in records.values()}
        base = min((r.offset for r in records.values()), default=0)
        end = max((r.offset + r.nbytes for r in records.values()), default=0)
        if len(files) != 1 or end - base != sum(r.nbytes for r in records.values()) \
                or any(r.offset % r.dtype.itemsize or r.checksum is not None or r.dtensor is not None
                       for r in records.values()):
            raise ValueError(f"group {group!r}: map_group needs tensors back to back in one file, each at an offset "
                             f"that is a multiple of its element size, without checksums or DTensor shards")
        identity = _identity(next(iter(files))) if files else ()
        self._records[group] = records
        self._mapped[group] = identity
        self.version += 1

    def mapped(self, group: str) -> bool:
        """True when ``group`` is served read-only from another file (``map_group``)."""
        return group in self._mapped

    def _check_mapped(self, group: str, records: Mapping[str, SwapRecord]) -> None:
        file = next(iter(records.values())).file
        try:
            same = _identity(file) == self._mapped[group]
        except FileNotFoundError:
            same = False
        if not same:
            raise ChecksumError(errno.EIO, f"group {group!r} is served from {file}, which was replaced, rewritten or "
                                           f"removed since it was mapped: its values may differ from those checked "
                                           f"then; map it (offload_parameters) again", file)

    # -- transfers ------------------------------------------------------------------------------------------
    def swap_out(self, groups: Groups, on_done: Callable[[], None] | None = None,
                 staged: SwapIn | None = None) -> SwapOut:
        """Start writing each group's tensors to its file; keep the tensors until the write is done.

        ``on_done`` runs once all are written, before any staging buffer is reused: drop your references to the
        tensors there. ``staged``: the ``SwapIn`` these tensors came from; its buffer is written from directly
        when they all still sit where they were read (no copy), and is released once the write is done."""
        self._check_open()
        if staged is not None and self.pack is not None:
            write = self._rewrite_extent(groups, staged, on_done)
            if write is not None:
                return write
        layout: dict[str, dict[str, tuple[torch.Tensor, Any, int]]] = {}
        total = 0
        for group, tensors in groups.items():
            self._check_group(group)
            if group in self._mapped:
                file = next(iter(self._records[group].values())).file
                raise PermissionError(errno.EACCES, f"group {group!r} is served read-only from {file} "
                                                    f"(map_group): it cannot be written", file)
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
        if self.pack is not None:
            return self._swap_out_packed(groups, layout, buffer, buffers, on_done)
        requests, records, start, shifts = [], {}, 0, {}
        for group, entries in layout.items():
            file = os.path.join(self.folder, f"{group}.swp")
            group_records, span = self._stage(group, entries, buffer, start, file, 0)
            records[group], shifts[group] = group_records, start
            if span:
                requests.append(self.handle.write_async(buffer[start:start + span], file))
            else:
                open(file, "wb").close()
            start += span
        write = SwapOut(self, requests, records, buffers, tuple(groups.values()), on_done, shifts=shifts)
        for group in records:
            self._writing[group] = write
        self._pending_out.append(write)
        return write

    def _stage(self, group: str, entries: dict, buffer: torch.Tensor, start: int, file: str,
               base: int) -> tuple[dict[str, SwapRecord], int]:
        """Copy a group's tensors into ``buffer`` from ``start`` (unless already there) and zero its padding;
        return its records (offsets: ``base`` + offset in the group) and its span (bytes, page-aligned)."""
        group_records, end = {}, 0
        checksum = None
        for key, (local, spec, offset) in entries.items():
            nbytes = local.numel() * local.element_size()
            region = buffer[start + offset:start + offset + nbytes]
            if nbytes and region.data_ptr() != local.data_ptr():
                region.view(local.dtype).view(local.shape).copy_(local)
            if self.config.checksum:
                checksum = _hash(region)
            group_records[key] = SwapRecord(key, local.dtype, tuple(local.shape), nbytes, file, base + offset,
                                            local.device, checksum, spec)
            end = offset + nbytes
        span = round_up(end, self._group_alignment)
        if span > end:
            buffer[start + end:start + span].zero_()  # no stale bytes in the file's padding
        return group_records, span

    def _swap_out_packed(self, groups: Groups, layout: dict, buffer: torch.Tensor, buffers: list[torch.Tensor],
                         on_done: Callable[[], None] | None) -> SwapOut:
        """All groups in one extent of the pack file (theirs, in place, when it holds exactly them), one request."""
        members, start = {}, 0
        for group, entries in layout.items():
            span = round_up(max((offset + local.numel() * local.element_size()
                                 for local, _, offset in entries.values()), default=0), PACKED_ALIGNMENT)
            members[group] = (start, span)
            start += span
        total = round_up(start)
        if members and total > start:  # the last group's span reaches the extent's (page-aligned) end
            last = next(reversed(members))
            members[last] = (members[last][0], members[last][1] + total - start)
            buffer[start:total].zero_()
        extent = self._extents.get(next(iter(members), ""))
        if extent is None or not extent.holds_exactly(members):
            extent = self.pack.allocate(total, members)
        records = {}
        for group, entries in layout.items():
            begin, _ = members[group]
            records[group], _ = self._stage(group, entries, buffer, begin, self.pack.path, extent.offset + begin)
        requests = [self.handle.write_async(buffer[:total], self.pack.path, extent.offset, truncate=False)] \
            if total else []
        write = SwapOut(self, requests, records, buffers, tuple(groups.values()), on_done, extent,
                        shifts=dict.fromkeys(records, -extent.offset))
        for group in records:
            self._writing[group] = write
        self._pending_out.append(write)
        return write

    def _rewrite_extent(self, groups: Groups, staged: SwapIn, on_done: Callable[[], None] | None) -> SwapOut | None:
        """Packed fast path: ``groups`` are exactly what ``staged`` read, all of one extent, as the same tensor
        objects (changed in place only): write the read buffer back over that extent, keeping the records.
        None when that does not hold."""
        names = list(groups)
        extent = self._extents.get(names[0]) if names else None
        if extent is None or extent.names != names or len(extent.live) != len(names) \
                or list(staged._layout) != names or not all(staged.views_of_buffer(g, groups[g]) for g in names):
            return None
        return self._write_back(extent, staged, on_done, tuple(groups.values()))

    def write_back(self, staged: SwapIn, on_done: Callable[[], None] | None = None) -> SwapOut | None:
        """Write the buffer of a read of one whole extent back over that extent, keeping the records: for a caller
        that checked the tensors ``staged.wait()`` returned are still exactly the groups' tensors (changed in place
        only). None (nothing done) when ``staged`` did not read a whole extent, or its groups live elsewhere now.
        ``on_done`` as for ``swap_out``."""
        self._check_open()
        extent = staged._extent
        if extent is None or staged._buffer is None or self._extents.get(extent.names[0]) is not extent \
                or len(extent.live) != len(extent.names) or list(staged._layout) != extent.names:
            return None
        return self._write_back(extent, staged, on_done, tuple(staged.wait().values()))

    def _write_back(self, extent: Extent, staged: SwapIn, on_done: Callable[[], None] | None,
                    sources: tuple) -> SwapOut:
        names = extent.names
        if self._writing:
            for group in names:
                self._wait_writing(group)
        staged._wait_io()
        buffer = staged._hand_over()
        records = {group: self._records[group] for group in names}
        if self.config.checksum:
            for group in names:
                start = staged._layout[group][0]
                records[group] = {key: dataclasses.replace(r, checksum=_hash(
                    buffer[start + r.offset:start + r.offset + r.nbytes]) if r.nbytes else 0)
                    for key, r in records[group].items()}
        request = self.handle.write_async(buffer[:extent.nbytes], self.pack.path, extent.offset, truncate=False)
        write = SwapOut(self, [request], records, [buffer], sources, on_done, extent, rewrite=True)
        writing = self._writing
        for group in names:
            writing[group] = write
        self._pending_out.append(write)
        return write

    def _settle_extents(self, groups: list[str], extent: Extent | None, ok: bool) -> None:
        """After a packed write to ``extent``: ``groups`` now live there (``ok``) or nowhere (the write failed, the
        bytes there are unknown); extents left empty are freed."""
        if extent is None:
            return
        for group in groups:
            old = self._extents.pop(group, None)
            if ok:
                self._extents[group] = extent
                extent.live.add(group)
            if old is not None and (old is not extent or not ok):
                old.leave(group)
        if not extent.live:
            self.pack.free(extent)

    def swap_in(self, groups: Iterable[str]) -> SwapIn:
        """Start reading the named groups back (each sized from its records). Groups with nothing on storage
        come back empty."""
        self._check_open()
        groups = list(groups)
        if self._writing:
            for group in groups:
                self._wait_writing(group)
        extent = self._whole_extent(groups)
        if extent is not None:
            return self._swap_in_extent(groups, extent)
        layout, total, spans = {}, 0, []
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
            layout[group] = (total - base, records)  # buffer position of a tensor: this + its record's offset
            if span:
                file = next(iter(records.values())).file
                if spans and spans[-1][0] == file and spans[-1][1] + spans[-1][3] == base \
                        and spans[-1][2] + spans[-1][3] == total:
                    spans[-1][3] += length  # adjacent on storage and in the buffer: one request
                else:
                    spans.append([file, base, total, length])
            total += span
        buffer = self._acquire(total) if total else None
        requests = [self.handle.read_async(buffer[start:start + span], file, offset)
                    for file, offset, start, span in spans]
        read = SwapIn(self, requests, layout, buffer)
        for group in layout:
            self._reading[group] = read
        return read

    def _whole_extent(self, groups: list[str]) -> Extent | None:
        """Packed: the extent whose members are exactly ``groups``, in order, all living there; else None."""
        extent = self._extents.get(groups[0]) if groups and self._extents else None
        if extent is None or len(extent.live) != len(groups) or extent.names != groups:
            return None  # live is a subset of the members: equal sizes and names mean all of them live there
        return extent

    def _swap_in_extent(self, groups: list[str], extent: Extent) -> SwapIn:
        """Read one whole extent with one request, into the buffer it was last read into when that is free."""
        records = self._records
        layout = {group: (-extent.offset, records[group]) for group in groups}
        cached = extent.views
        buffer = self._acquire(extent.nbytes, prefer=cached[0] if cached is not None else None)
        request = self.handle.read_async(buffer[:extent.nbytes], self.pack.path, extent.offset)
        read = SwapIn(self, [request], layout, buffer, extent)
        reading = self._reading
        for group in groups:
            reading[group] = read
        return read

    def discard(self, group: str) -> None:
        """Forget a group and delete its file (packed: free its part of its extent)."""
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
            try:
                os.unlink(next(iter(records.values())).file)
            except FileNotFoundError:
                pass

    def wait_all(self) -> None:
        """Wait for every write in flight; raise the first failure after all have finished."""
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
            if not self.config.keep_files:
                remove_run_folder(self.folder)

    def __enter__(self) -> "TensorSwapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this TensorSwapper is closed")

    @staticmethod
    def _check_group(group: str) -> None:
        if not isinstance(group, str) or not group or not all(c.isalnum() or c in "-_." for c in group) \
                or group.startswith("."):
            raise ValueError(f"group name {group!r}: use letters, digits, '-', '_' and '.' (it names a file)")

    def _wait_writing(self, group: str) -> None:
        write = self._writing.get(group)
        if write is not None:
            write.wait()

    def _forget(self, buffer: torch.Tensor) -> None:
        """``buffer`` leaves the pool (views of it stay in use); no extent keeps views of it for reuse."""
        self.pool.forget(buffer)
        for extent in set(self._extents.values()):
            if extent.views is not None and extent.views[0] is buffer:
                extent.views = None

    def _acquire(self, nbytes: int, prefer: torch.Tensor | None = None) -> torch.Tensor:
        """A staging buffer of ``nbytes`` (``prefer`` when it is free): a pooled one, waiting for the oldest write
        to free one if needed, or a one-off buffer when nothing in flight can free one (the pool's bound is then
        exceeded only briefly)."""
        while True:
            buffer = self.pool.try_acquire(nbytes, prefer)
            if buffer is not None:
                return buffer
            if not self._pending_out:
                return self.pool.one_off(nbytes)
            try:
                self._pending_out[0].wait()
            except OSError:
                pass  # reported to whoever waits for that write; its buffer left the pool, so look again

    @staticmethod
    def _in_place(layout: dict, buffer: torch.Tensor, alignment: int) -> bool:
        """True when every tensor already sits in ``buffer`` exactly where ``layout`` puts it."""
        base, start = buffer.data_ptr(), 0
        for entries in layout.values():
            end = 0
            for local, _, offset in entries.values():
                nbytes = local.numel() * local.element_size()
                if nbytes and (local.device.type != "cpu" or not local.is_contiguous()
                               or local.data_ptr() != base + start + offset):
                    return False
                end = offset + nbytes
            start += round_up(end, alignment)
        return start <= buffer.numel()
