"""Work in flight, one protocol: ``Pending`` (``wait(timeout=None)``, ``done()``, ``result(timeout=None)``).

It is shared by ``Request`` (one transfer), ``SwapOut``/``SwapIn`` (a swapper's writes and reads) and
``save_async``'s future; the timeouts of its waits are computed here too (``deadline_after``, ``remaining``).
"""

from __future__ import annotations

import abc
import concurrent.futures
import math
import threading
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

    Examples:
        >>> import torch, deepoffload
        >>> with deepoffload.AsyncIOHandle() as handle:
        ...     pending = handle.write_async(torch.ones(16), "ones.bin")
        ...     isinstance(pending, deepoffload.Pending)
        ...     pending.wait(timeout=60)
        ...     pending.done(), pending.result()
        True
        64
        (True, 64)
    """

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> T:
        """Block until finished; return the result or raise the error.

        Args:
            timeout: Seconds to wait at most (>= 0); None waits until finished. Past it, ``TimeoutError`` (with no
                errno) is raised and nothing is lost.

        Returns:
            The result of the work.
        """

    @abc.abstractmethod
    def done(self) -> bool:
        """True once finished, successfully or not; never blocks and never raises the work's error."""

    def result(self, timeout: float | None = None) -> T:
        """The same as ``wait(timeout)``, as on ``concurrent.futures.Future``.

        Args:
            timeout: Seconds to wait at most (>= 0); None waits until finished.

        Returns:
            The result of the work.
        """
        return self.wait(timeout)


def settle(pending: Iterable[Pending], timeout: float | None) -> None:
    """Block until each of ``pending`` has finished, without raising their errors.

    Each keeps its own error for the wait that follows.

    Args:
        pending: The work to wait for.
        timeout: Seconds to wait at most for all of them together (>= 0); None waits until all have finished.

    Raises:
        TimeoutError: Once ``timeout`` seconds have passed (with no errno; an IO error ``ETIMEDOUT`` of one of them
            is kept by it instead).
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
    """A ``concurrent.futures.Future`` that is also ``Pending``.

    ``result``, ``exception``, ``add_done_callback`` and ``concurrent.futures.wait`` all work; ``wait(timeout)`` is
    ``result(timeout)`` raising the built-in ``TimeoutError``.
    """

    def wait(self, timeout: float | None = None) -> T:
        """Block until the future is settled; return its result or raise its exception.

        Args:
            timeout: Seconds to wait at most (>= 0); None waits until settled.

        Returns:
            The future's result.

        Raises:
            TimeoutError: When it is not settled after ``timeout`` seconds (the built-in type, not
                ``concurrent.futures.TimeoutError`` where that differs).
        """
        deadline = deadline_after(timeout)  # the same check of the value as every other wait
        # infinity waits until settled; a finite wait is capped where the clock's range ends (centuries)
        seconds = None if deadline is None else min(float(timeout or 0), threading.TIMEOUT_MAX)
        try:
            return super().result(seconds)
        except concurrent.futures.TimeoutError as e:
            if isinstance(e, TimeoutError):
                raise
            raise TimeoutError(str(e) or "still running") from None

    def result(self, timeout: float | None = None) -> T:
        """The same as ``wait(timeout)``.

        Args:
            timeout: Seconds to wait at most (>= 0); None waits until settled.

        Returns:
            The future's result.
        """
        return self.wait(timeout)

    def run(self, fn: Callable[..., T], *args: Any) -> None:
        """Run ``fn(*args)`` here and settle this future with its result or exception (for an executor's thread).

        Nothing runs when the future was cancelled before.

        Args:
            fn: The work.
            *args: Its arguments.
        """
        if not self.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:
            self.set_exception(e)
        else:
            self.set_result(result)


def deadline_after(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` by which a wait of ``timeout`` seconds ends.

    Args:
        timeout: Seconds (>= 0; infinity waits forever), or None to wait forever.

    Returns:
        The deadline, or None to wait forever.

    Raises:
        TypeError: When ``timeout`` is not a number (or is a bool).
        ValueError: When ``timeout`` is negative or NaN.
    """
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
