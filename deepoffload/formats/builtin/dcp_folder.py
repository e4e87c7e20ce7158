"""A ``torch.distributed.checkpoint`` (DCP) folder: recognised, so that a reader can say how to convert it.

Its tensors are pickled per item inside its ``.distcp`` files, not raw bytes at known offsets; ``deepoffload.dcp``
reads and writes such folders through DCP's own planner.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import CheckpointError
from ..protocol import CheckpointFormat, OpenedCheckpoint

METADATA_NAME = ".metadata"  # DCP's file naming every data file of a checkpoint


class DcpFolder(CheckpointFormat):
    """A DCP folder (``.metadata`` and ``*.distcp`` files): refused at open with the one-line conversion."""

    name = "dcp"
    description = "a torch.distributed.checkpoint folder (convert it once with dcp_to_torch_save)"
    reads = False

    def detect(self, path: Path) -> bool:
        """Return whether ``path`` is a folder holding ``.metadata`` or a ``.distcp`` file.

        Args:
            path: The path given to a reader.

        Returns:
            Whether it is one of this format's checkpoints.
        """
        return path.is_dir() and ((path / METADATA_NAME).is_file() or next(path.glob("*.distcp"), None) is not None)

    def open(self, path: Path) -> OpenedCheckpoint:
        """Refuse: this reader reads raw or mapped tensors, and DCP's are neither.

        Args:
            path: The folder.

        Raises:
            CheckpointError: Always, naming the conversion that makes a file this reads.
        """
        raise CheckpointError(
            f"{path}: a torch.distributed.checkpoint (DCP) folder; this reads safetensors or torch.save: "
            "convert it once with torch.distributed.checkpoint.format_utils.dcp_to_torch_save(folder, "
            "'model.pt') and pass model.pt"
        )
