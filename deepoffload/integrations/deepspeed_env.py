"""The variable that tells DeepSpeed's child processes to use deepoffload's op (see ``deepspeed_children``).

It is set by ``enable()`` and restored by ``disable()``. It lives apart from ``deepspeed_children`` so that
``enable()`` can set it without importing the import hook, which itself calls ``enable()``.
"""

from __future__ import annotations

import os

ENV = "DEEPOFFLOAD_DEEPSPEED"


def mark_children() -> str | None:
    """Sets the variable for child processes; returns its previous value (None when unset)."""
    previous = os.environ.get(ENV)
    os.environ[ENV] = "1"
    return previous


def unmark_children(previous: str | None) -> None:
    """Gives the variable back the value ``mark_children`` returned.

    Args:
        previous: The earlier value; None unsets the variable.
    """
    if previous is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = previous
