"""What a checkpoint format is: one object that finds its checkpoints and says where their tensors lie.

A format (one file each, registered in ``deepoffload.formats.registry``) answers three questions: is this path one of
mine (``detect``), what tensors does it hold and where (``open``, returning an ``OpenedCheckpoint``), and, where the
format writes, how to save tensors in it (``save``). Reading is not the format's job: ``CheckpointReader`` reads every
format's tensors the same way, so a new format gets span reads through the async-IO op, read-ahead, dtype checks and
the file-changed checks for free.

An ``OpenedCheckpoint`` holds its tensors in one of two ways:

- ``files``: tensors whose raw little-endian bytes lie in files at known byte ranges (a ``Header`` per file, a
  ``TensorEntry`` per tensor); ``CheckpointReader`` reads them through the op (safetensors, sharded safetensors);
- ``mapped``: tensors already mapped into memory from one file, copied out on read (``torch.save``).
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Mapping

from ..errors import CheckpointError, UnsupportedError

if TYPE_CHECKING:  # (torch is imported by the formats' methods: listing the registry stays cheap)
    import torch

    from .header import Header


@dataclass(frozen=True)
class OpenedCheckpoint:
    """The tensors a format found at a path, and where their bytes lie (see the module docstring).

    Attributes:
        files: One ``Header`` per file of raw tensor bytes, in storage order (empty for a mapped checkpoint).
        mapped: Name -> tensor mapped from ``mapped_path`` (None for a checkpoint of ``files``).
        mapped_path: The file the mapped tensors come from.
        mapped_identity: That file's identity (``file_identity``) before it was mapped, so a change shows.
        metadata: The checkpoint's string metadata (a single safetensors file's ``__metadata__``), or None.

    Examples:
        >>> import torch
        >>> from pathlib import Path
        >>> from deepoffload.formats import get_format, save_file
        >>> _ = save_file({"w": torch.ones(2, 3)}, "model.safetensors")
        >>> opened = get_format("safetensors").open(Path("model.safetensors"))
        >>> entry = opened.files[0].entries["w"]
        >>> entry.dtype, entry.shape, entry.nbytes
        (torch.float32, (2, 3), 24)
    """

    files: tuple[Header, ...] = ()
    mapped: dict[str, torch.Tensor] | None = None
    mapped_path: str = ""
    mapped_identity: tuple[int, ...] = ()
    metadata: dict[str, str] | None = field(default=None)

    def __post_init__(self) -> None:
        """Refuse what a reader could only read one way or another: both kinds, or a name in two files.

        Raises:
            ValueError: When both ``files`` and ``mapped`` are given, or ``mapped`` without the file it is mapped
                from and that file's identity (a change to the file could not be seen).
            CheckpointError: When two files hold a tensor of the same name.
        """
        if self.files and self.mapped is not None:
            raise ValueError("an OpenedCheckpoint holds files of raw tensors or mapped tensors, not both")
        if self.mapped is not None and not (self.mapped_path and self.mapped_identity):
            raise ValueError(
                "mapped tensors need mapped_path and mapped_identity (file_identity(os.stat(path)) taken before "
                "mapping), so that a change to the file is refused"
            )
        seen: dict[str, str] = {}
        for header in self.files:
            for name in header.entries:
                if name in seen:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {seen[name]} and {header.path}: which one a reader gives "
                        f"would depend on the order of the files"
                    )
                seen[name] = header.path


class CheckpointFormat(abc.ABC):
    """A kind of checkpoint: how to find one, where its tensors lie and (optionally) how to write one.

    Subclass it in one file, give it a unique ``name`` and a one-line ``description``, and register an instance with
    ``deepoffload.formats.register_format``; every reader, ``deepoffload plan``, ``offload_parameters(checkpoint=...)``
    and ``from_pretrained`` then open it.

    Attributes:
        name: The format's short name (``CheckpointReader.format`` gives it), unique in the registry.
        description: What a path of this format is, in a few words (listed by ``deepoffload plan --help``, the
            report and the docs).
        reads: Whether ``CheckpointReader`` reads it (a format that is only recognised refuses at ``open``, saying
            what to do instead).
        writes: Whether ``save`` writes this format.
        serves: Whether its tensors' bytes lie as stored in files (``OpenedCheckpoint.files``), so that a streamed
            model can read them from where they lie instead of copying them to swap files first.

    Examples:
        A folder of raw little-endian files named by a small JSON file (``raw_file`` describes each file):

        >>> import json, os, torch
        >>> from pathlib import Path
        >>> from deepoffload.formats import CheckpointReader, register_format, unregister_format
        >>> from deepoffload.formats import CheckpointFormat, OpenedCheckpoint, raw_file
        >>> class RawFolder(CheckpointFormat):
        ...     name, description = "raw-folder", "a folder of raw tensor files named by raw.json"
        ...     def detect(self, path):
        ...         return (path / "raw.json").is_file()
        ...     def open(self, path):
        ...         layout = json.loads((path / "raw.json").read_text())
        ...         return OpenedCheckpoint(files=tuple(
        ...             raw_file(path / file, {name: (getattr(torch, dtype), tuple(shape), 0)})
        ...             for name, (file, dtype, shape) in layout.items()))
        >>> os.makedirs("raw", exist_ok=True)
        >>> _ = Path("raw/w.bin").write_bytes(torch.arange(4.0).numpy().tobytes())
        >>> _ = Path("raw/raw.json").write_text(json.dumps({"w": ["w.bin", "float32", [4]]}))
        >>> _ = register_format(RawFolder())
        >>> with CheckpointReader("raw") as reader:
        ...     reader.format, reader.read()
        ('raw-folder', {'w': tensor([0., 1., 2., 3.])})
        >>> _ = unregister_format("raw-folder")
    """

    name: ClassVar[str]
    description: ClassVar[str]
    reads: ClassVar[bool] = True
    writes: ClassVar[bool] = False
    serves: ClassVar[bool] = False

    @abc.abstractmethod
    def detect(self, path: Path) -> bool:
        """Return whether ``path`` (an existing file or folder) is a checkpoint of this format.

        Cheap: a name, a suffix or a file's first bytes; ``open`` validates.

        Args:
            path: The path given to a reader.

        Returns:
            Whether it is one of this format's checkpoints.
        """

    @abc.abstractmethod
    def open(self, path: Path) -> OpenedCheckpoint:
        """Validate the checkpoint at ``path`` and say where its tensors lie.

        Args:
            path: A path ``detect`` accepted.

        Returns:
            Its tensors (see ``OpenedCheckpoint``).
        """

    def save(self, tensors: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
        """Write ``tensors`` at ``path`` in this format.

        Args:
            tensors: Name -> tensor.
            path: Where to write.

        Raises:
            UnsupportedError: For a format that does not write (``writes`` is False).
        """
        raise UnsupportedError(f"deepoffload does not write the {self.name} checkpoint format ({self.description})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
