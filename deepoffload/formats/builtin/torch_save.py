"""A ``torch.save`` file in torch's zip format holding a state dict: mapped into memory to read, written through the op.

``deepoffload.save`` (``deepoffload.checkpoint``, the layer above) writes any object so; this format saves state dicts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from ...errors import CheckpointError
from ..protocol import CheckpointFormat, OpenedCheckpoint

if TYPE_CHECKING:  # (torch and the readers are imported by the methods: listing the registry stays cheap)
    import torch

ZIP_MAGIC = b"PK\x03\x04"  # the first bytes of a zip archive, as torch.save writes by default


class TorchSave(CheckpointFormat):
    """A ``torch.save`` state dict (zip format), mapped with ``mmap=True`` and copied out tensor by tensor."""

    name = "torch"
    description = "a torch.save file (zip format) holding a state dict"
    writes = True

    def detect(self, path: Path) -> bool:
        """Return whether ``path`` is a file that starts as a zip archive does.

        Args:
            path: The path given to a reader.

        Returns:
            Whether it is one of this format's checkpoints.
        """
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(len(ZIP_MAGIC)) == ZIP_MAGIC

    def open(self, path: Path) -> OpenedCheckpoint:
        """Map the state dict (see ``load_torch``), noting the file's identity first.

        Args:
            path: The file.

        Returns:
            The mapped state dict.
        """
        from ..header import file_identity

        identity = file_identity(os.stat(path))  # before mapping it: a change during the load shows
        return OpenedCheckpoint(mapped=load_torch(path), mapped_path=str(path), mapped_identity=identity)

    def save(self, tensors: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
        """Write ``tensors`` as ``torch.save(dict(tensors), path)`` would, through the op, with CRC-32s, fsynced.

        Written under a private temporary name and renamed over ``path`` (``deepoffload.save`` without its wait for a
        pending ``save_async``).

        Args:
            tensors: Name -> tensor.
            path: The file to write.
        """
        from ..torch_zip.torch_format import record
        from ..torch_zip.write_file import write_file

        write_file(record(dict(tensors)), os.fspath(path), checksum=True, sync=True, config=None)


def load_torch(path: Path) -> dict[str, torch.Tensor]:
    """Map a ``torch.save`` state dict into memory (``mmap=True``, ``weights_only=True``, to the CPU).

    Args:
        path: The ``torch.save`` file.

    Returns:
        The state dict: a flat dict of name -> tensor, whose storages are mapped from the file.

    Raises:
        CheckpointError: When torch cannot load the file so, a storage is not exactly its record's bytes, or it holds
            anything but a flat dict of name -> tensor.
    """
    import torch

    from ..torch_zip.whole_file import load_mapped

    try:  # torch.load(mmap=True) with every storage checked against its record, as deepoffload.load does
        done, state = load_mapped(str(path), "cpu", True, None, {})
        if not done:  # a TorchScript archive, or what the weights-only unpickler refuses: torch says why
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except CheckpointError:
        raise  # names the file, the record and both sizes
    except Exception as e:
        raise CheckpointError(
            f"{path}: cannot load it as a torch.save state dict (read with mmap=True, weights_only=True): {e}"
        ) from None
    if not is_state_dict(state):
        inside = [k for k, v in state.items() if is_state_dict(v)] if isinstance(state, dict) else []
        hint = (
            f": a dict holding state dicts under {inside}; save the model's alone (torch.save(saved[{inside[0]!r}], "
            f"path)) to stream from it (`deepoffload plan --key {inside[0]}` reads it as it is)"
            if inside
            else ""
        )
        raise CheckpointError(
            f"{path}: a torch.save checkpoint must hold a flat dict of name -> tensor "
            f"(a state_dict); got {type(state).__name__}{hint}"
        )
    return state


def is_state_dict(value: object) -> bool:
    """Return whether ``value`` is a flat dict of name -> tensor.

    Args:
        value: Anything.
    """
    import torch

    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
