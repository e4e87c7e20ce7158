"""Transfers in flight between a ``TensorSwapper`` and its files: ``SwapOut`` (writes) and ``SwapIn`` (reads).

They know their swapper only as a ``TransferOwner``: its staging buffers, whether it checksums, and the three calls
through which a transfer that finished hands its outcome back (the swapper keeps its own books).
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol, cast

import torch

from ..errors import ChecksumError, ClosedError
from ..io.request import Request
from ..pending import Pending, settle
from .codecs import decoding
from .codecs.decoding import Decode
from .records import SwapRecord, contiguous_strides, hash_bytes

if TYPE_CHECKING:
    from .extents import Extent
    from .staging_buffers import StagingBuffers


class TransferOwner(Protocol):
    """What a transfer needs of its swapper (``TensorSwapper`` is one)."""

    staging: StagingBuffers
    checksum: bool  # records carry checksums: views of a read are not kept for reuse (each read checks them)

    def settle_write(
        self,
        write: SwapOut,
        records: dict[str, dict[str, SwapRecord]],
        extent: Extent | None,
        rewrite: bool,
        ok: bool,
        nbytes: int,
    ) -> None:
        """Put a finished write's records in force (``ok``) or drop the groups' records (it failed)."""

    def forget_write(self, write: SwapOut) -> None:
        """The write has finished and handed back its buffers: it is no longer in flight."""

    def read_done(self, read: SwapIn, groups: Iterable[str], nbytes: int) -> None:
        """The reads of ``groups`` have finished (``nbytes`` read; 0 when they failed)."""


class SwapOut(Pending[int]):
    """Writes in flight for some groups (``Pending``), as ``TensorSwapper.swap_out`` returns them.

    ``wait(timeout=None)`` returns the bytes written once the new records are in force and the staging buffer is
    released; on failure it raises the first ``OSError`` and the caller's tensors stay its own (nothing was freed).
    Made by the swapper, not by callers.

    Args:
        swapper: The swapper whose groups are written.
        requests: The write requests in flight.
        records: ``{group: {key: SwapRecord}}``: the records that come into force once the writes are done.
        buffers: The staging buffer written from, and the swap-in buffer it replaces, if any (released when done).
        sources: The caller's tensors, kept alive until their bytes are written.
        on_done: Runs once all are written, before any staging buffer is reused.
        extent: Packed: where these groups are being written (new, or theirs rewritten in place).
        rewrite: The groups' records stay as they are (same sizes, same place).
        shifts: ``{group: its tensors' position in the staging buffer less their file offset}``.

    Examples:
        >>> import torch
        >>> from deepoffload import SwapConfig, TensorSwapper
        >>> swapper = TensorSwapper(SwapConfig(folder=".", pin=False))
        >>> write = swapper.swap_out({"layer0": {"weight": torch.ones(2, 2)}})
        >>> write.staged()["layer0"]["weight"].tolist()
        [[1.0, 1.0], [1.0, 1.0]]
        >>> write.wait(), write.done()
        (4096, True)
        >>> swapper.close()
    """

    def __init__(
        self,
        swapper: TransferOwner,
        requests: list[Request],
        records: dict[str, dict[str, SwapRecord]],
        buffers: list[torch.Tensor],
        sources: tuple,
        on_done: Callable[[], None] | None,
        extent: Extent | None = None,
        rewrite: bool = False,
        shifts: dict[str, int] | None = None,
    ):
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
        """True once the writes have finished, successfully or not; never blocks."""
        return self._result is not None or all(r.done() for r in self._requests)

    def staged(self) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors being written, as views of the staging buffer the write reads from.

        For a caller that frees its own tensors now rather than when the write is done: from here on this write no
        longer keeps the caller's tensors alive. The views hold the same bytes; they stay valid until ``on_done``
        runs, and for good if the write fails (the buffer leaves the pool).

        Returns:
            ``{group: {key: view}}`` of the CPU tensors that are not DTensors (others are left out; empty tensors
            too); empty once the write has finished.
        """
        if self._result is not None or not self._buffers or not self._shifts:
            return {}
        buffer = self._buffers[0]
        typed: dict[torch.dtype, torch.Tensor] = {}
        views: dict[str, dict[str, torch.Tensor]] = {}
        for group, records in self._records.items():
            shift = self._shifts[group]
            views[group] = {}
            for key, r in records.items():
                if r.device.type != "cpu" or r.dtensor is not None or not r.nbytes:
                    continue
                view = typed.get(r.dtype)
                if view is None:
                    view = typed[r.dtype] = buffer.view(r.dtype)
                views[group][key] = view.as_strided(
                    r.shape,
                    contiguous_strides(r.shape),
                    view.storage_offset() + (r.offset + shift) // r.dtype.itemsize,
                )
        self._sources = ()
        return views

    def wait(self, timeout: float | None = None) -> int:
        """Block until the writes have finished, then put the new records in force and release the staging buffer.

        Waiting again returns the same result or raises the same error. On failure the groups' records are dropped
        and the buffers leave the pool (the caller's tensors stay its own); the first ``OSError`` is raised.

        Args:
            timeout: Seconds to wait at most (None: no limit); ``TimeoutError`` then, and a later wait finishes.

        Returns:
            The bytes written (whole pages).
        """
        if self._result is None:
            if timeout is not None:
                settle(self._requests, timeout)  # TimeoutError before anything changes; a later wait finishes
            self._finish()
        if isinstance(self._result, BaseException):
            raise self._result
        return cast(int, self._result)  # _finish() set it: the bytes written, or the error raised above

    def _finish(self) -> None:
        swapper, error, nbytes = self._swapper, None, 0
        for request in self._requests:
            try:
                nbytes += request.wait()
            except OSError as e:
                error = error or e
        swapper.settle_write(self, self._records, self._extent, self._rewrite, error is None, nbytes)
        if error is None:
            if self._on_done is not None:
                self._on_done()
            for buffer in self._buffers:
                swapper.staging.release(buffer)
        else:
            for buffer in self._buffers:
                swapper.staging.forget(buffer)  # views of it may stay resident in the caller's hands
        self._result = error if error is not None else nbytes
        self._requests, self._sources, self._buffers, self._on_done, self._extent = [], (), [], None, None
        swapper.forget_write(self)


class SwapIn(Pending[dict]):
    """Reads in flight for some groups (``Pending``), as ``TensorSwapper.swap_in`` returns them.

    ``wait(timeout=None)`` returns ``{group: {key: tensor}}``: views of one pooled buffer (CPU tensors) that stay
    valid until those groups are swapped out again or ``release()`` is called. Made by the swapper, not by callers.

    Args:
        swapper: The swapper whose groups are read.
        requests: The read requests in flight.
        layout: ``{group: (start in the buffer, records)}``: where each tensor lands (start + its record's offset).
        buffer: The staging buffer read into (None when there is nothing to read).
        extent: Packed: the one extent read whole (its views may be reused), else None.
        decodes: The groups stored encoded (``Decode``): each decoded into ``buffer`` on the decode pool as soon as
            its own read is done (``codecs/decoding.py``), while the caller computes.

    Examples:
        >>> import torch
        >>> from deepoffload import SwapConfig, TensorSwapper
        >>> swapper = TensorSwapper(SwapConfig(folder=".", pin=False))
        >>> swapper.swap_out({"layer0": {"weight": torch.arange(4.0)}}).wait()
        4096
        >>> read = swapper.swap_in(["layer0"])
        >>> tensors = read.wait()
        >>> tensors["layer0"]["weight"].tolist()
        [0.0, 1.0, 2.0, 3.0]
        >>> read.views_of_buffer("layer0", tensors["layer0"])
        True
        >>> read.release()
        >>> swapper.close()
    """

    def __init__(
        self,
        swapper: TransferOwner,
        requests: list[Request],
        layout: dict[str, tuple[int, dict]],
        buffer: torch.Tensor | None,
        extent: Extent | None = None,
        decodes: list[Decode] | None = None,
    ):
        self._swapper = swapper
        self._decodes = decoding.start(decodes) if decodes else []  # futures: None or the error to raise
        self._extent = extent  # packed: the one extent read whole (its views may be reused), else None
        self._requests = requests
        self._layout = layout  # group -> (start in buffer, records)
        self._buffer = buffer
        self._tensors: dict[str, dict[str, torch.Tensor]] | None = None
        self._error: OSError | None = None

    def done(self) -> bool:
        """True once the reads have finished, successfully or not; never blocks."""
        return self._tensors is not None or (
            all(r.done() for r in self._requests) and all(d.done() for d in self._decodes)
        )

    def wait(self, timeout: float | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """Block until the reads have finished; return the tensors (the same objects on every later call).

        On a read error the buffer is released and the first ``OSError`` is raised; a tensor whose checksum does not
        match raises ``ChecksumError``. Waiting again raises the same error. Tensors swapped out from another device
        are copied back to it, DTensor shards come back as DTensors.

        Args:
            timeout: Seconds to wait at most (None: no limit); ``TimeoutError`` then, and a later wait finishes.

        Returns:
            ``{group: {key: tensor}}``, CPU tensors being views of this read's buffer.

        Raises:
            ChecksumError: When a tensor's bytes do not match the checksum recorded when it was written (the buffer is
                released).
        """
        if self._tensors is None:
            if timeout is not None:
                settle(self._requests, timeout)  # TimeoutError before anything changes; a later wait finishes
            error = self.wait_io()
            if error is not None:
                self.release()
                raise error
            tensors = self._cached_views()
            if tensors is None:
                typed: dict = {}
                try:
                    tensors = {
                        group: {key: self._restore(start, record, typed) for key, record in records.items()}
                        for group, (start, records) in self._layout.items()
                    }
                except ChecksumError as e:  # kept (the buffer is released): a later wait raises it again
                    self._error = e
                    raise
                self._cache_views(tensors)
            self._tensors = tensors
        return self._tensors

    def _cached_views(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """The views made the last time this extent was read into this same buffer, if any.

        Used when its records are still the same objects (the layout is unchanged): making a tensor costs
        microseconds, many small ones add up.

        Returns:
            A copy of the cached ``{group: {key: view}}``, or None when there is none to reuse.
        """
        if self._extent is None:
            return None
        return self._extent.cached_views(self._buffer, [records for _, records in self._layout.values()])

    def _cache_views(self, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Keep ``tensors`` for the next read of this extent into this buffer, when that is safe.

        That is when they are plain CPU views of a pooled buffer and carry no checksum to verify.
        """
        swapper = self._swapper
        buffer = self._buffer
        if self._extent is None or buffer is None or swapper.checksum or not swapper.staging.pool.pooled(buffer):
            return
        records = [records for _, records in self._layout.values()]
        if all(r.device.type == "cpu" and r.dtensor is None and r.nbytes for rs in records for r in rs.values()):
            self._extent.keep_views(buffer, records, tensors)

    def views_of_buffer(self, group: str, tensors: Mapping[str, torch.Tensor]) -> bool:
        """True when ``tensors`` are exactly the tensors ``wait()`` returned for ``group``.

        That is the same objects, all CPU views of this read's buffer, so their bytes already sit where that group's
        file layout puts them.

        Args:
            group: The group's name.
            tensors: ``{key: tensor}`` to compare.

        Returns:
            Whether ``tensors`` are this read's own views for ``group`` (False before ``wait()``, after
            ``release()``, or for a group it did not read).
        """
        mine = self._tensors.get(group) if self._tensors is not None and self._buffer is not None else None
        if mine is None or mine.keys() != tensors.keys():
            return False
        records = self._layout[group][1]
        return all(
            tensors[key] is value and records[key].dtensor is None and records[key].device.type == "cpu"
            for key, value in mine.items()
        )

    @property
    def extent(self) -> Extent | None:
        """Packed: the one extent this read read whole, else None."""
        return self._extent

    def groups(self) -> list[str]:
        """The groups read, in the order of the buffer.

        Returns:
            Their names.
        """
        return list(self._layout)

    def start(self, group: str) -> int:
        """Where ``group``'s tensors are counted from in the buffer (a tensor lies at this + its record's offset).

        Args:
            group: A group this read read.

        Returns:
            The position (bytes; negative for a packed extent, whose records hold file offsets).
        """
        return self._layout[group][0]

    def holds_buffer(self) -> bool:
        """True while this read still has its staging buffer (not released nor handed to a write).

        Returns:
            Whether it has one.
        """
        return self._buffer is not None

    def wait_io(self) -> OSError | None:
        """Finish the reads (the files may be rewritten after this).

        Returns:
            The first error (kept for later), or None.
        """
        error, nbytes = self._error, 0
        for request in self._requests:
            try:
                nbytes += request.wait()
            except OSError as e:
                error = error or e
        self._requests = []
        if self._decodes:  # always waited for, so that no decode writes into the buffer once it is released
            decodes, self._decodes = self._decodes, []
            decoded = decoding.finish(decodes)
            error = error or decoded
        self._error = error
        self._swapper.read_done(self, self._layout, nbytes if error is None else 0)
        return error

    def _restore(self, start: int, record: SwapRecord, typed: dict) -> torch.Tensor:
        """The record's tensor as a view of the buffer (``typed``: the buffer viewed as each dtype, reused)."""
        if record.nbytes == 0:
            local = torch.empty(record.shape, dtype=record.dtype)
        else:
            position = start + record.offset
            buffer = self._buffer
            if buffer is None:
                raise ClosedError(
                    f"{record.key!r}: this read's buffer was released or handed to a write before "
                    f"wait() made its tensors"
                )
            if record.checksum is not None:
                region = buffer[position : position + record.nbytes]
                if hash_bytes(region) != record.checksum:
                    self.release()
                    raise ChecksumError(
                        errno.EIO,
                        f"checksum mismatch for {record.key!r} ({record.nbytes} bytes at "
                        f"offset {record.offset}): the swap file was changed or corrupted",
                        record.file,
                    )
            view = typed.get(record.dtype)
            if view is None:
                view = typed[record.dtype] = buffer.view(record.dtype)
            local = view.as_strided(
                record.shape,
                contiguous_strides(record.shape),
                view.storage_offset() + position // record.dtype.itemsize,
            )
        if record.device.type != "cpu":
            local = local.to(record.device)
        if record.dtensor is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = record.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def release(self) -> None:
        """Give the staging buffer back (after waiting for the reads); the tensors from ``wait()`` die with it."""
        self.wait_io()
        if self._buffer is not None:
            self._swapper.staging.release(self._buffer)
            self._buffer = None

    def detach(self) -> None:
        """The tensors from ``wait()`` stay in use indefinitely: the buffer leaves the pool (freed with them)."""
        buffer = self.hand_over()
        if buffer is not None:
            self._swapper.staging.forget(buffer)

    def hand_over(self) -> torch.Tensor | None:
        """Give up the staging buffer to a ``SwapOut`` that takes charge of it.

        Returns:
            The buffer (None when it was released or handed over already).
        """
        if self._decodes:
            self.wait_io()  # (no decode may still write into a buffer that changes hands)
        buffer, self._buffer = self._buffer, None
        return buffer
