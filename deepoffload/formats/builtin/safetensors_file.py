"""A safetensors file (``*.safetensors``), or a folder holding one as ``model.safetensors``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from ...errors import CheckpointError
from ..protocol import CheckpointFormat, OpenedCheckpoint

if TYPE_CHECKING:  # (torch and the readers are imported by the methods: listing the registry stays cheap)
    import torch

SINGLE_NAME = "model.safetensors"  # a Hugging Face folder's checkpoint when it is one file
TORCH_SUFFIXES = (".pt", ".pth", ".bin")  # names torch.save files are given


class SafetensorsFile(CheckpointFormat):
    """One safetensors file; it claims every file no format before it in the registry claimed, to say what is wrong."""

    name = "safetensors"
    description = "a .safetensors file, or a folder holding model.safetensors"
    writes = True
    serves = True

    def detect(self, path: Path) -> bool:
        """Return whether ``path`` is a file, or a folder holding ``model.safetensors``.

        Args:
            path: The path given to a reader.

        Returns:
            Whether it is one of this format's checkpoints.
        """
        return path.is_file() or (path / SINGLE_NAME).is_file()

    def open(self, path: Path) -> OpenedCheckpoint:
        """Read and validate the file's header.

        Args:
            path: The file, or the folder holding ``model.safetensors``.

        Returns:
            The file's tensors and metadata.

        Raises:
            CheckpointError: When the file is not valid safetensors (for a ``.pt``/``.pth``/``.bin`` name, saying
                that a torch.save file must be in torch's zip format).
        """
        from ..header import read_header

        file = path / SINGLE_NAME if path.is_dir() else path
        try:
            header = read_header(file)
        except CheckpointError as e:
            if file.suffix in TORCH_SUFFIXES:
                raise CheckpointError(
                    f"{e}; as a torch.save file it is not in torch's zip format (saved with "
                    f"_use_new_zipfile_serialization=False?): re-save it with torch.save defaults"
                ) from None
            raise
        return OpenedCheckpoint(files=(header,), metadata=header.metadata)

    def save(self, tensors: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
        """Write ``tensors`` as one safetensors file (``deepoffload.formats.save_file``).

        Args:
            tensors: Name -> tensor.
            path: The file to write.
        """
        from ..writer import save_file

        save_file(tensors, path)
