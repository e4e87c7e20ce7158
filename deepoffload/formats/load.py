"""Load a whole checkpoint (or the tensors named) into a dict in one call, through ``CheckpointReader``.

``load_file`` opens the checkpoint, checks it against ``expected`` when asked, reads the tensors and closes the
reader (and the handle it made).
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from ..io.handle import AsyncIOHandle
from .checks import DtypeSpec, Expected
from .reader import CheckpointReader


def load_file(
    path: str | os.PathLike,
    *,
    dtype: DtypeSpec = None,
    names: Iterable[str] | None = None,
    expected: Expected | None = None,
    strict: bool = True,
    handle: AsyncIOHandle | None = None,
) -> dict[str, torch.Tensor]:
    """Load a checkpoint (any layout ``CheckpointReader`` opens) into ``{name: tensor}``.

    Args:
        path: The checkpoint (a file or folder; see ``CheckpointReader``).
        dtype: One dtype for every floating point tensor, or name -> dtype (default: as stored).
        names: The tensors to load (default: all).
        expected: When given, first check the checkpoint's names and shapes against it (see
            ``CheckpointReader.check``).
        strict: With ``expected``: whether missing and unexpected names are errors.
        handle: An ``AsyncIOHandle`` to read with (default: one made and closed here).

    Returns:
        The tensors by name, in storage order.

    Examples:
        >>> import torch
        >>> from deepoffload.formats import load_file, save_file
        >>> _ = save_file({"weight": torch.arange(4.0)}, "model.safetensors")
        >>> load_file("model.safetensors")
        {'weight': tensor([0., 1., 2., 3.])}
        >>> load_file("model.safetensors", dtype=torch.bfloat16, expected={"weight": (4,)})
        {'weight': tensor([0., 1., 2., 3.], dtype=torch.bfloat16)}
    """
    with CheckpointReader(path, handle=handle) as reader:
        if expected is not None:
            reader.check(expected, strict=strict)
        return reader.read(names, dtype)
