"""Fast checkpoints: ``save``/``save_async``/``load`` in ``torch.save``'s format with the bytes moved by the op.

The bytes go through the async-IO op; ``deepoffload.dcp`` does the same for ``torch.distributed.checkpoint``. The
layer above ``deepoffload.formats``, whose ``torch_zip`` package moves ``torch.save``'s zip format through the op.
"""

from .api import load, save, save_async

__all__ = ["load", "save", "save_async"]
