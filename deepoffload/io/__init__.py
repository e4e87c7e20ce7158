"""The Python side of the async-IO op: handles, requests and aligned, page-locked buffers."""

from .buffers import aligned_empty, is_aligned, is_pinned
from .handle import AsyncIOHandle, Request, ValidationError

__all__ = ["AsyncIOHandle", "Request", "ValidationError", "aligned_empty", "is_aligned", "is_pinned"]
