"""Checkpoint formats read and written through the async-IO op: safetensors (single files and Hugging Face sharded
folders) and torch.save state dicts (read only).

Names are imported on first access, so ``import deepoffload.formats`` stays cheap.
"""

import importlib

_LAZY = {
    "CheckpointError": "header", "DTYPES": "header",
    "CheckpointReader": "reader", "KeyReport": "reader", "load_file": "reader",
    "save_sharded": "writer", "save_file": "writer",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'deepoffload.formats' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
