"""Work in flight, one protocol: ``Pending`` (``wait(timeout=None)``, ``done()``, ``result(timeout=None)``), shared by
``Request`` (one transfer), ``SwapOut``/``SwapIn`` (a swapper's writes and reads) and ``save_async``'s future; and
the timeouts of its waits (``deadline_after``, ``remaining``).
"""

from __future__ import annotations

import abc
import concurrent.futures
import math
import time
from typing import Any, Callable, Generic, Iterable, TypeVar

T = TypeVar("T")


class Pending(abc.ABC, Generic[T]):
    """Something in flight that finishes on its own.

    ``wait(timeout=None)`` blocks until it has finished and returns its result or raises its error; with
    ``timeout`` (seconds, >= 0) it raises ``TimeoutError`` (with no errno) if it has not finished by then, and
    nothing is lost: a later wait picks up where this one stopped. Waiting again returns the same result (or raises
    the same error). ``done()`` says whether it has finished, never blocks and never raises its error.
    ``result(timeout=None)`` is ``wait``, as on ``concurrent.futures.Future``.
    """

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> T:
        """Block until finished; return the result or raise the error (``TimeoutError`` after ``timeout`` s)."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once finished, successfully or not; never blocks."""

    def result(self, timeout: float | None = None) -> T:
        """The same as ``wait(timeout)``."""
        return self.wait(timeout)


def settle(pending: Iterable[Pending], timeout: float | None) -> None:
    """Block until each of ``pending`` has finished, or raise ``TimeoutError`` once ``timeout`` seconds have passed.
    Their errors are not raised here: each keeps its own for the wait that follows.
    """
    deadline = deadline_after(timeout)
    for item in pending:
        try:
            item.wait(None if deadline is None else remaining(deadline))
        except TimeoutError as e:
            if e.errno is None:  # this wait's time is up (an IO error ETIMEDOUT carries its errno: kept, as below)
                raise
        except Exception:  # kept by ``item``: the caller's next wait raises it
            pass


class PendingFuture(concurrent.futures.Future, Pending[T]):
    """A ``concurrent.futures.Future`` (``result``, ``exception``, ``add_done_callback``, ``concurrent.futures.wait``
    all work) that is also ``Pending``: ``wait(timeout)`` is ``result(timeout)`` raising the built-in
    ``TimeoutError``.
    """

    def wait(self, timeout: float | None = None) -> T:
        deadline_after(timeout)  # the same check of the value as every other wait
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError as e:
            if isinstance(e, TimeoutError):
                raise
            raise TimeoutError(str(e) or "still running") from None

    def result(self, timeout: float | None = None) -> T:
        return self.wait(timeout)

    def run(self, fn: Callable[..., T], *args: Any) -> None:
        """Run ``fn(*args)`` here and settle this future with its result or exception (for an executor's thread)."""
        if not self.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:
            self.set_exception(e)
        else:
            self.set_result(result)


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
