"""The Python side of the async-IO op: handles, requests and aligned, page-locked buffers.

Names are imported on first access, so ``deepoffload.io.native`` and the engine registry ``deepoffload.io.engines``
can be used (by the report) without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".handle": ["AsyncIOHandle", "ValidationError"],
        ".request": ["Request"],
        ".buffers": ["aligned_empty", "is_aligned", "is_pinned"],
    },
)

if TYPE_CHECKING:
    from .buffers import aligned_empty, is_aligned, is_pinned
    from .handle import AsyncIOHandle, ValidationError
    from .request import Request
