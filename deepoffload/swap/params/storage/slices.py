"""Slices of a block's stored parameter read alone (one expert each), beside its ``BlockStore``."""

from __future__ import annotations

import errno
import time
from typing import Callable, Sequence

import torch

from ....errors import ChecksumError
from ...records import hash_bytes
from ..blocks.residency import Block
from .store import BlockStore


def runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending ``rows`` as runs of adjacent rows, ``(first, end)`` each (one read per run).

    Args:
        rows: Row indices, ascending, without repeats.

    Returns:
        The runs, in order.
    """
    out: list[tuple[int, int]] = []
    for row in rows:
        if out and out[-1][1] == row:
            out[-1] = (out[-1][0], row + 1)
        else:
            out.append((row, row + 1))
    return out


def read_slices(
    store: BlockStore, block: Block, name: str, rows: Sequence[int], out: torch.Tensor
) -> Callable[[], None]:
    """Start reading rows of ``block``'s stored parameter ``name`` (slices along its first dimension, one expert each).

    Adjacent rows are one request. A row's bytes are checked against its checksum when the record has them
    (``SwapRecord.slices``); a served file is checked unchanged (size, modification time, inode) before reading.

    Args:
        store: The blocks' store (its bytes read count the slices).
        block: The block (ON_STORAGE or read without the parameter).
        name: The parameter's name in the block; its record is raw (codec ``none``).
        rows: The rows to read, ascending.
        out: A contiguous tensor of the parameter's shape and dtype; ``out[row]`` receives each row.

    Returns:
        A function that waits for the reads; it raises ``OSError`` naming the parameter and block when one failed, and
        ``ChecksumError`` naming the parameter, the row and the file when a row's bytes differ from those written.

    Raises:
        ChecksumError: When the block is served from a file that changed since it was loaded.
    """
    swapper = store.swapper
    records = swapper.records(block.group)
    record = records[name]
    size = record.nbytes // out.shape[0]
    if swapper.mapped(block.group):
        try:
            swapper.mapped_files.check(block.group, records)
        except ChecksumError as e:
            raise store.read_error(block, e) from e
    handle = swapper.io.of(record.file)  # (the drive's own queue, with several folders)
    requests = [handle.read_async(out[a:b], record.file, record.offset + a * size) for a, b in runs(rows)]
    store.slice_bytes += size * len(rows)

    def wait() -> None:
        start = time.perf_counter()
        try:
            for request in requests:
                request.wait()
        except OSError as e:
            raise store.read_error(block, e) from e
        finally:
            store.io_wait += time.perf_counter() - start
        for row in rows if record.checksum is not None else ():
            if hash_bytes(out[row].view(-1).view(torch.uint8)) != record.slices[row]:
                raise ChecksumError(
                    errno.EIO,
                    f"checksum mismatch for expert {row} of parameter {block.qualified(name)} (block {block.prefix}): "
                    f"the swap file was changed or corrupted since it was written",
                    record.file,
                )

    return wait
