"""Fast checkpoints: ``save``/``save_async``/``load`` in ``torch.save``'s format with the bytes moved by the op.

The bytes go through the async-IO op; ``deepoffload.dcp`` does the same for ``torch.distributed.checkpoint``.
"""

from .api import load, save, save_async

__all__ = ["load", "save", "save_async"]
