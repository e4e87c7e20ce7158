"""Slices of a block's stored parameter read alone (one expert each), beside its ``BlockStore``."""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..blocks.residency import Block
from .store import BlockStore


def read_slices(
    store: BlockStore, block: Block, name: str, count: int, wanted: dict[int, torch.Tensor]
) -> Callable[[], None]:
    """Start reading slices of ``block``'s stored parameter ``name`` along its first dimension (one expert each).

    Args:
        store: The blocks' store (its bytes read count the slices).
        block: The block (ON_STORAGE or read without the parameter).
        name: The parameter's name in the block; its record holds ``count`` equal slices, raw (codec ``none``).
        count: How many slices the record holds (its first dimension).
        wanted: Slice index -> contiguous tensor of one slice's shape and dtype to read into.

    Returns:
        A function that waits for the reads; it raises ``OSError`` naming the parameter and block when one failed.
    """
    swapper = store.swapper
    record = swapper.records(block.group)[name]
    size = record.nbytes // count
    handle = swapper.io.of(record.file)  # (the drive's own queue, with several folders)
    requests = [handle.read_async(t, record.file, record.offset + k * size) for k, t in wanted.items()]
    store.slice_bytes += size * len(wanted)

    def wait() -> None:
        start = time.perf_counter()
        try:
            for request in requests:
                request.wait()
        except OSError as e:
            raise store.read_error(block, e) from e
        finally:
            store.io_wait += time.perf_counter() - start

    return wait
