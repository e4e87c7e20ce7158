"""Fault in the pages of new read buffers before their reads are submitted, from one thread or two.

A span buffer fresh from the allocator is backed page by page on first touch; doing that before the read is
submitted keeps the faults off the read's path. ``fault_in`` does it by ``MADV_POPULATE_WRITE`` or by writing a
zero to each page from two threads, the faster way when the memory faults in slowly (``SLOW_FAULT_BYTES_PER_S``).
"""

from __future__ import annotations

import threading

import torch

from ..io.buffers import prefault

PAGE_BYTES = 4096  # a write per this many bytes faults every page in (huge pages: the first write of each)
FAULT_SPLIT_PAGES = 1024  # buffers of fewer than twice this many pages are faulted in by the calling thread alone
# Span buffers are faulted in by the calling thread (as fast as the disk reads here when the memory was freed
# recently: about 7 GB/s) until faulting runs slower than this, then by two threads (memory this VM handed back to
# its host while idle faults in at 0.5-1.2 GB/s from one thread; two writing threads made a cold load 1.6x as fast,
# while with recycled memory they gained nothing and lost more rounds to slow ones)
SLOW_FAULT_BYTES_PER_S = 3e9


def fault_in(buffer: torch.Tensor, threads: int) -> None:
    """Back every page of the new (zero-filled) uint8 ``buffer`` now.

    Measured here (1 GiB of new huge-page memory, interleaved): writes from two threads fault in 1.5-1.7x as fast as
    one thread or as ``MADV_POPULATE_WRITE``, which gains nothing from a second thread.

    Args:
        buffer: The new buffer.
        threads: 1: by ``MADV_POPULATE_WRITE`` (``prefault``); 2: by writing a zero to each page, half of them from
            a second thread (a buffer of under ``2 * FAULT_SPLIT_PAGES`` pages is faulted in by ``prefault``).
    """
    pages = buffer[::PAGE_BYTES]
    half = pages.numel() // 2
    if threads == 1 or half < FAULT_SPLIT_PAGES:
        prefault(buffer)
        return
    worker = threading.Thread(target=pages[half:].fill_, args=(0,), name="deepoffload-fault-in")
    worker.start()
    try:
        pages[:half].fill_(0)
    finally:
        worker.join()
