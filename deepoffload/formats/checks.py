"""The checks ``CheckpointReader`` makes: of what the caller asks for, and that a file is still the one opened.

``KeyReport`` is what ``CheckpointReader.check`` returns; the helpers here read one entry of its ``expected``
mapping, tell which stored dtypes may be converted to which, and raise when a file was removed, replaced or
rewritten since its header was read.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence, Union

import torch

from .header import CheckpointError, file_identity

DtypeSpec = Union[torch.dtype, Mapping[str, torch.dtype], None]
Expected = Mapping[str, Union[torch.Tensor, Sequence[int], tuple]]


class KeyReport(NamedTuple):
    """Names the model expects that the checkpoint lacks, and names the checkpoint has that the model does not.

    What ``CheckpointReader.check(expected, strict=False)`` returns (with ``strict=True`` either list not empty is an
    error instead).

    Attributes:
        missing: Names of ``expected`` that the checkpoint lacks.
        unexpected: Names in the checkpoint that ``expected`` lacks.

    Examples:
        >>> import torch
        >>> from deepoffload.formats import CheckpointReader, save_file
        >>> save_file({"w": torch.zeros(2), "extra": torch.ones(1)}, "model.safetensors")
        PosixPath('model.safetensors')
        >>> with CheckpointReader("model.safetensors") as reader:
        ...     reader.check({"w": (2,), "b": (2,)}, strict=False)
        KeyReport(missing=['b'], unexpected=['extra'])
    """

    missing: list[str]
    unexpected: list[str]


def _expected_shape_dtype(name: str, value: object) -> tuple[tuple[int, ...], torch.dtype | None]:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype):
        return tuple(int(s) for s in value[0]), value[1]
    if isinstance(value, (tuple, list, torch.Size)):
        return tuple(int(s) for s in value), None
    raise TypeError(
        f"expected[{name!r}]: give a tensor (a meta tensor will do), a shape, or (shape, dtype); got "
        f"{type(value).__name__}"
    )


def convertible(stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether a tensor stored as ``stored`` may be read as ``target``: the same dtype, or floating to floating."""
    return stored == target or (stored.is_floating_point and target.is_floating_point)


def compare_keys(
    stored: Iterable[str],
    shape_dtype: Callable[[str], tuple[tuple[int, ...], torch.dtype]],
    expected: Expected,
    strict: bool,
    refusal: Callable[[str, bool], str],
    unexpected_before: Sequence[str] = (),
) -> KeyReport:
    """Compare stored tensors with ``expected``: the one check behind every reader's ``check``.

    A shape that differs, or a dtype that cannot be converted (only floating point converts to floating point), is
    always an error; missing and unexpected names are errors when ``strict``, else returned.

    Args:
        stored: The stored names.
        shape_dtype: Stored name -> (shape, dtype) as stored.
        expected: Name -> tensor, shape or (shape, dtype).
        strict: Whether missing and unexpected names are errors.
        refusal: (the problems joined, whether names are among them) -> the error's message.
        unexpected_before: Unexpected names found before this comparison (listed first).

    Returns:
        The missing and unexpected names.

    Raises:
        CheckpointError: Listing every problem, when any.
    """
    names = list(stored)
    present = set(names)
    missing = [n for n in expected if n not in present]
    unexpected = [*unexpected_before, *(n for n in names if n not in expected)]
    mismatched = []
    for name, value in expected.items():
        if name in present:
            shape, dtype = _expected_shape_dtype(name, value)
            stored_shape, stored_dtype = shape_dtype(name)
            if stored_shape != shape:
                mismatched.append(f"{name}: checkpoint {list(stored_shape)}, expected {list(shape)}")
            elif dtype is not None and not convertible(stored_dtype, dtype):
                mismatched.append(f"{name}: checkpoint {stored_dtype} cannot become {dtype} exactly")
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} mismatched: " + "; ".join(mismatched[:20]))
    if strict and missing:
        problems.append(f"{len(missing)} missing: {missing[:20]}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} unexpected: {unexpected[:20]}")
    if problems:
        raise CheckpointError(refusal("; ".join(problems), bool(strict and (missing or unexpected))))
    return KeyReport(missing, unexpected)


def check_unchanged(path: str, identity: tuple[int, ...]) -> None:
    """Raise unless ``path`` is still the file whose header was read at open.

    The op reads by path, so a file replaced (a new save renamed over it) or rewritten since would be read at
    the old header's offsets; a torch.save file's mapping would show a rewrite in place, and touching it past a
    shortened end kills the process (SIGBUS).

    Args:
        path: The file.
        identity: Its ``file_identity`` at open.

    Raises:
        CheckpointError: When the file was removed, replaced or rewritten.
    """
    try:
        now = file_identity(os.stat(path))
    except FileNotFoundError:
        now = None
    if now != identity:
        what = "was removed" if now is None else "was replaced or rewritten"
        raise CheckpointError(
            f"{path} {what} after this reader read its header (the tensors' offsets may no "
            f"longer hold them); open a new CheckpointReader to read the file as it is now"
        )
