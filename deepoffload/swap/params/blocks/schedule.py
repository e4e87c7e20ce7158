"""The prefetch schedule: which blocks to read while one computes."""

from __future__ import annotations


def upcoming(index: int, count: int, prefetch: int, phase: str, training: bool) -> list[int]:
    """The next ``prefetch`` distinct blocks (of ``count``) expected after block ``index`` in ``phase``.

    Forward runs blocks in order and, when training, backward runs them in reverse.

    Args:
        index: The block running now.
        count: How many blocks there are.
        prefetch: How many blocks to look ahead.
        phase: "forward" or "backward".
        training: Whether a backward follows the forward.

    Returns:
        The indices of those blocks, the soonest first.
    """
    if phase == "forward":
        order = list(range(index + 1, count)) + (list(range(count - 1, -1, -1)) if training else list(range(count)))
    else:
        order = list(range(index - 1, -1, -1))
    window: list[int] = []
    for j in order:
        if len(window) == prefetch:
            break
        if j not in window:
            window.append(j)
    return window
