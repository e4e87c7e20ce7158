"""deepoffload: train and run PyTorch models whose weights and optimizer state do not fit in memory, by moving
tensors between memory and fast local storage at close to the device's full speed.

Importing this package is cheap: nothing is probed, compiled or loaded until an op is first used, and names below are
imported on first access.
"""

from __future__ import annotations

import importlib

from .version import __version__

_LAZY = {
    "AsyncIOHandle": "deepoffload.io.handle",
    "Request": "deepoffload.io.handle",
    "ValidationError": "deepoffload.io.handle",
    "aligned_empty": "deepoffload.io.buffers",
    "is_aligned": "deepoffload.io.buffers",
    "is_pinned": "deepoffload.io.buffers",
    "AioConfig": "deepoffload.config",
    "ConfigError": "deepoffload.config",
    "SwapConfig": "deepoffload.swap.config",
    "TensorSwapper": "deepoffload.swap.tensor_swapper",
    "ChecksumError": "deepoffload.swap.tensor_swapper",
    "OffloadedOptimizer": "deepoffload.swap.optimizer",
    "offload_parameters": "deepoffload.swap.params",
    "ParameterOffload": "deepoffload.swap.params",
    "OffloadStats": "deepoffload.swap.params",
    "find_blocks": "deepoffload.swap.params",
    "save": "deepoffload.checkpoint.api",
    "save_async": "deepoffload.checkpoint.api",
    "load": "deepoffload.checkpoint.api",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deepoffload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
