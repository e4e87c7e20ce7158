"""The exceptions deepoffload defines, under one base: ``except deepoffload.DeepOffloadError`` catches all of them.

Also ``naming_target``, which restates a save's ``OSError`` to name the file saved. Besides these the library raises
only built-in types with a meaning of their own: ``OSError`` with an errno, ``ValueError``/``TypeError`` for a bad
argument, ``TimeoutError`` from a wait (``tests/test_errors.py`` states and checks the rule).

Each also derives from the built-in type that code caught before this base existed, so no ``except`` clause changes
meaning: errors that carry an errno are ``OSError`` (``except OSError`` keeps working), bad arguments and use after
close are ``ValueError``, refused patterns are ``RuntimeError``. Torch-free, imported by every layer above
``op_builder``. The base itself is defined in ``op_builder.errors`` (the lowest layer, which imports nothing from
here), so the op builders' ``BuildError`` (a ``RuntimeError``, exported as ``deepoffload.BuildError``) and
``EnvError`` (a ``ValueError``) belong to the family too.
"""

from __future__ import annotations

from .op_builder.errors import DeepOffloadError


class ConfigError(DeepOffloadError, ValueError):
    """A config key or value that is not accepted.

    A ``ValueError``; the message names the key and what is accepted.
    """


class ClosedError(DeepOffloadError, ValueError, RuntimeError):
    """An object (handle, swapper, offload) was used after ``close()``.

    A ``ValueError``, as Python's own files raise after close; also a ``RuntimeError``, which some of these paths
    raised before this type existed, so existing ``except`` clauses still catch it.
    """


class ChecksumError(DeepOffloadError, OSError):
    """Bytes read back from storage do not match the checksum recorded when they were written.

    An ``OSError``: errno ``EIO`` when raised with one.
    """


class ValidationError(DeepOffloadError, OSError):
    """``validate=True`` found the file's bytes differ from the tensor's.

    An ``OSError`` with errno ``EIO`` and the file's path as its ``filename``; the message gives the offset.
    """


class CheckpointError(DeepOffloadError, ValueError):
    """A checkpoint file or index is malformed, missing or does not match what the caller expects.

    A ``ValueError``; the message names the file.
    """


class CheckpointNotFoundError(FileNotFoundError, CheckpointError):
    """A checkpoint (file, folder or shard) that is not there.

    Also a ``FileNotFoundError`` (an ``OSError`` with errno ``ENOENT`` and the missing path as ``filename``), as
    ``safetensors`` and ``torch.load`` raise for a missing file, so ``except FileNotFoundError`` and ``except OSError``
    catch it as well as ``except CheckpointError``.
    """


class ResidencyError(DeepOffloadError, RuntimeError):
    """A block was asked to move between residency states in an order that would lose or misuse its values.

    A ``RuntimeError``.
    """


class UnsupportedError(DeepOffloadError, RuntimeError):
    """A usage pattern, platform or feature deepoffload cannot serve exactly, refused at the first call.

    A ``RuntimeError``; the message names it and what to do instead.
    """


class MemoryBudgetError(DeepOffloadError, MemoryError):
    """A ``max_memory`` limit that the offload or optimizer asked to keep cannot hold even its least configuration.

    Raised before anything is moved, so the model and optimizer are left as they were. A ``MemoryError``; the
    message gives the least limit that works and what it is made of.
    """


class StreamedParameterError(UnsupportedError):
    """A streamed model's parameters used in a way that would read placeholders, lose a write or step a block twice.

    Such uses are copying, pickling, reading or writing them one by one, an optimizer of one's own, a backward
    through a stale forward. An ``UnsupportedError``; the message names the pattern and what to use instead.
    """


class BenchError(DeepOffloadError):
    """A problem of a benchmark or tuning run (``deepoffload bench``/``tune``) the user can fix (folder, space, tool).

    Its message is one line saying what to do.
    """


def naming_target(error: OSError, target: str) -> OSError:
    """Restate ``error`` from saving ``target`` through a temporary file (which it names) to name ``target``.

    Args:
        error: The error of the save, naming the temporary file.
        target: The file saved.

    Returns:
        An ``OSError`` naming ``target`` (and the temporary in its message); with the same errno, so of the same
        subclass (``FileNotFoundError``, ...), when ``error`` has one.
    """
    detail = error.strerror or str(error)
    if error.filename and error.filename != target:
        detail += f" (writing {error.filename})"
    if error.errno is None:
        return OSError(f"cannot save {target}: {detail}")
    return OSError(error.errno, f"cannot save {target}: {detail}", target)


__all__ = [
    "BenchError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "ClosedError",
    "ConfigError",
    "DeepOffloadError",
    "MemoryBudgetError",
    "ResidencyError",
    "StreamedParameterError",
    "UnsupportedError",
    "ValidationError",
]
