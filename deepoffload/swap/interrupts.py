"""Ctrl-C inside deepoffload's own bookkeeping takes effect when that bookkeeping is done.

A block's move between memory and storage is several Python steps (start a write, drop the parameters, note the new
state); a ``KeyboardInterrupt`` raised between two of them left a block marked in memory whose parameters were
placeholders, or an optimizer state half restored, so nothing after it (``state_dict()``, ``close()``) worked.
Inside ``deferred()`` (entered by every hook and public call of ``ParameterOffload``, by ``OffloadedOptimizer.step``
and by each chunk it steps inside backward) SIGINT is only noted, and raised as ``KeyboardInterrupt`` when it ends:
between blocks during forward and backward, at the end of ``step()``, after a chunk stepped inside backward.
User code between hooks (the blocks' own computation) is interrupted at once, as without offloading. A second
Ctrl-C inside the same call raises at once (for a call stuck on a device that does not answer), at the price of the
bookkeeping it interrupts.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold back SIGINT until the block ends, then raise ``KeyboardInterrupt``; a second SIGINT raises at once.

    Only in the main thread and only over Python's default handler (a handler the program installed is left to do
    its own thing).

    Yields:
        Nothing; the block runs with SIGINT held back.

    Raises:
        KeyboardInterrupt: When the block ends after a SIGINT was held back.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    noted: list[int] = []

    def note(signum: int, frame) -> None:
        if noted:
            raise KeyboardInterrupt(
                "second Ctrl-C: raised inside deepoffload's bookkeeping, whose state may now "
                "be inconsistent; restart from the last checkpoint"
            )
        noted.append(signum)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:  # an exception already on its way out (a second Ctrl-C's included) goes on as it is
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if noted:
        raise KeyboardInterrupt
