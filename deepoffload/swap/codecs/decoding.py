"""Decoding encoded groups on a small thread pool, each as soon as its own read has finished.

A read of encoded groups (``TensorSwapper.swap_in``) hands each group's decode here when it starts: a pool thread
waits for that group's read request (the wait releases the GIL), then decodes its stored bytes straight into the
group's place in the staging buffer. So a block's decode runs while the caller computes on the block before it and
while the next blocks' reads are in flight, not when the caller waits for it. zstandard's decompression and numpy's
byte-plane copies release the GIL, so two decodes (and the caller) run on two cores at once.

``finish`` collects the outcomes in order: the first read error or ``ChecksumError`` (a record that does not decode
to its length) is returned for the read to raise. Nothing is lost if a decode is never waited for: the read's
``release`` waits for its decodes before its buffer goes back to the pool.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import threading
from typing import TYPE_CHECKING, NamedTuple

from ...errors import ChecksumError

if TYPE_CHECKING:
    import torch

    from ...io.request import Request
    from .base import ByteCodec

THREADS = max(1, min(4, os.cpu_count() or 1))  # decodes in flight at once; the caller's own thread computes

_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


class Decode(NamedTuple):
    """One encoded group of a read: its stored bytes, decoded into its place in the staging buffer once read."""

    codec: ByteCodec
    stored: torch.Tensor  # exactly the encoded bytes (a view of a one-off buffer they are read into)
    out: torch.Tensor  # the group's range of the staging buffer (its whole, page-aligned span)
    file: str
    request: Request  # the read of ``stored``


def _reset_after_fork() -> None:
    """A forked child has no pool threads: it makes its own pool when it first decodes."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's decode pool (made on first use, ``THREADS`` daemon-like worker threads).

    Returns:
        The executor.
    """
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="deepoffload-decode")
        return _pool


def start(decodes: list[Decode]) -> list[concurrent.futures.Future]:
    """Queue each decode: it runs on the pool once its read has finished.

    Args:
        decodes: The encoded groups of one read, in order.

    Returns:
        One future per decode; its result is None or the error (``OSError``, ``ChecksumError``) to raise.
    """
    return [pool().submit(run, decode) for decode in decodes]


def run(decode: Decode) -> OSError | None:
    """Wait for ``decode``'s read, then decode its stored bytes into its place in the staging buffer.

    Args:
        decode: The group to decode.

    Returns:
        None when it decoded to its length; the read's ``OSError``, or a ``ChecksumError`` naming the file.
    """
    try:
        decode.request.wait()
    except OSError as e:
        return e  # the read itself failed: reported as it is (the read's own wait reports it too)
    try:
        nbytes = decode.codec.decode(decode.stored, decode.out)
    except Exception as e:  # noqa: BLE001 - whatever a codec raises on bad bytes is reported as corrupt
        error = ChecksumError(
            errno.EIO, f"stored bytes do not decode with codec {decode.codec.name!r} ({e!r})", decode.file
        )
        error.__cause__ = e
        return error
    if nbytes != decode.out.numel():
        return ChecksumError(
            errno.EIO,
            f"stored bytes decode with codec {decode.codec.name!r} to {nbytes} bytes, not the "
            f"{decode.out.numel()} written: the swap file was changed or corrupted",
            decode.file,
        )
    return None


def finish(futures: list[concurrent.futures.Future]) -> OSError | None:
    """Wait for every decode of a read (all of them, so none still writes into the buffer afterwards).

    Args:
        futures: What ``start`` returned.

    Returns:
        The first error in order, or None.
    """
    errors = [future.result() for future in futures]
    return next((e for e in errors if e is not None), None)
