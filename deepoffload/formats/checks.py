"""The checks ``CheckpointReader`` makes: of what the caller asks for, and that a file is still the one opened.

``KeyReport`` is what ``CheckpointReader.check`` returns; the helpers here read one entry of its ``expected``
mapping, tell which stored dtypes may be converted to which, and raise when a file was removed, replaced or
rewritten since its header was read.
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple, Sequence, Union

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


def _convertible(stored: torch.dtype, target: torch.dtype) -> bool:
    return stored == target or (stored.is_floating_point and target.is_floating_point)


def _check_unchanged(path: str, identity: tuple[int, ...]) -> None:
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
