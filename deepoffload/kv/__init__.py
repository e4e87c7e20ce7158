"""The KV cache of a transformers model on storage: ``StorageCache``."""

from .cache import StorageCache

__all__ = ["StorageCache"]
