"""The Python side of the async-IO op: handles, requests and aligned, page-locked buffers.

Names are imported on first access, so ``deepoffload.io.native`` can be used (by the report) without importing torch.
"""

import importlib

_LAZY = {
    "AsyncIOHandle": "handle", "Request": "handle", "ValidationError": "handle",
    "aligned_empty": "buffers", "is_aligned": "buffers", "is_pinned": "buffers",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'deepoffload.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
