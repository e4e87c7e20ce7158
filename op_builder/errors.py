"""The base of every exception deepoffload defines.

It lives here in the lowest layer so that the op builders' own errors (``BuildError``, ``EnvError``) share it;
``deepoffload.errors`` re-exports it with the rest of the family.
"""

from __future__ import annotations


class DeepOffloadError(Exception):
    """Base of every exception defined by deepoffload: ``except deepoffload.DeepOffloadError`` catches each of them.

    Each subclass also derives from the built-in type (``OSError``, ``ValueError``, ``RuntimeError``) that callers'
    ``except`` clauses use.
    """
