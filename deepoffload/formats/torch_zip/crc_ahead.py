"""The CRC-32 of a save's large records, computed on a background thread from the records' own memory.

The main thread meanwhile copies the same bytes into staging buffers: the copy and the CRC (the slowest part of a
save on a fast disk: one pass over every byte) run at once instead of one after the other. The zip format needs
each record's CRC right after its data, so the writer waits for it there; the thread, started first, is usually
done by then. zlib's ``crc32`` releases the GIL on large buffers.

A plain thread, not an executor: a ``save_async`` still writing at interpreter exit runs after ``concurrent.futures``
refuses new work. Where no thread can be started, the CRCs are computed as the bytes are staged, as for small
records.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from ...errors import CheckpointError
from ...io.crc import crc32

AHEAD_MIN_BYTES = 1 << 20  # smaller records are checksummed as they are staged: a thread hop would cost more


class _Pending:
    """One record's CRC being computed: ``result()`` waits for it (or raises the error computing it raised)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.value: int | BaseException = 0

    def result(self) -> int:
        self.ready.wait()
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class CrcAhead:
    """Start computing, in order, the CRC-32 of every large record in host memory of ``records``.

    The records' memory must stay unchanged until ``close()``, which waits for the thread.

    Args:
        records: ``(name, data, nbytes)`` tuples (see ``torch_format``); those of at least ``AHEAD_MIN_BYTES`` whose
            data is a CPU ``UntypedStorage`` are checksummed here.
    """

    def __init__(self, records: list) -> None:
        self._jobs = [
            (name, data.data_ptr(), nbytes)
            for name, data, nbytes in records
            if nbytes >= AHEAD_MIN_BYTES and isinstance(data, torch.UntypedStorage) and data.device.type == "cpu"
        ]
        self._pending = {name: _Pending() for name, _, _ in self._jobs}
        self._stop = False
        self._thread = None
        if self._jobs:
            thread = threading.Thread(target=self._run, name="deepoffload-crc")
            try:
                thread.start()
                self._thread = thread
            except RuntimeError:  # no new threads now (interpreter shutdown): staged digests instead
                self._pending = {}

    def _run(self) -> None:
        for name, address, nbytes in self._jobs:
            pending = self._pending[name]
            try:
                if self._stop:
                    raise CheckpointError("the save was abandoned")
                pending.value = crc32((ctypes.c_char * nbytes).from_address(address))
            except BaseException as e:  # handed to the writer waiting for this record
                pending.value = e
            pending.ready.set()

    def get(self, name: str) -> _Pending | None:
        """Return the CRC being computed for record ``name``, or None for a record left to the staging digest.

        Args:
            name: The record's name.

        Returns:
            Its ``_Pending`` (``result()`` waits for the CRC), or None.
        """
        return self._pending.get(name)

    def close(self) -> None:
        """Stop the thread (records not yet begun fail as abandoned) and wait for it."""
        self._stop = True
        if self._thread is not None:
            self._thread.join()
