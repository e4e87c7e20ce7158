"""Work in flight: the timeouts of its waits (``deadline_after``, ``remaining``)."""

from __future__ import annotations

import math
import time


def deadline_after(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` by which a wait of ``timeout`` seconds ends; None to wait forever."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout: expected seconds (a number) or None, got {type(timeout).__name__}")
    timeout = float(timeout)
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (or None to wait until done), got {timeout!r}")
    return None if math.isinf(timeout) else time.monotonic() + timeout


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value), 0 once it has passed."""
    return max(0.0, deadline - time.monotonic())
