"""Checkpoint formats read and written through the async-IO op.

Safetensors (single files and Hugging Face sharded folders) and torch.save state dicts, each a
``CheckpointFormat`` in ``registry`` (one file each under ``builtin/``; ``register_format`` adds one); ``torch_zip``
moves ``torch.save``'s zip format through the op for ``deepoffload.checkpoint`` (``save``/``load``), the layer above.

Names are imported on first access, so ``import deepoffload.formats`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".header": ["CheckpointError", "CheckpointNotFoundError", "DTYPES", "raw_file"],
        ".reader": ["CheckpointReader"],
        ".checks": ["KeyReport"],
        ".load": ["load_file"],
        ".writer": ["save_sharded", "save_file"],
        ".protocol": ["CheckpointFormat", "OpenedCheckpoint"],
        ".registry": ["checkpoint_formats", "detect_format", "get_format", "register_format", "unregister_format"],
    },
)

if TYPE_CHECKING:
    from .checks import KeyReport
    from .header import DTYPES, CheckpointError, CheckpointNotFoundError, raw_file
    from .load import load_file
    from .protocol import CheckpointFormat, OpenedCheckpoint
    from .reader import CheckpointReader
    from .registry import checkpoint_formats, detect_format, get_format, register_format, unregister_format
    from .writer import save_file, save_sharded
