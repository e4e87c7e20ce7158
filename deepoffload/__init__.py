"""deepoffload: train and run PyTorch models whose weights and optimizer state do not fit in memory.

It moves tensors between memory and fast local storage at close to the device's full speed.

Importing this package is cheap: nothing is probed, compiled or loaded until an op is first used, and names below are
imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from ._link import op_builder as _op_builder
from .version import __version__

_op_builder()  # deepoffload.op_builder, also in a bare source checkout

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".errors": [
            "DeepOffloadError",
            "ConfigError",
            "ClosedError",
            "ChecksumError",
            "ValidationError",
            "CheckpointError",
            "CheckpointNotFoundError",
            "MemoryBudgetError",
            "ResidencyError",
            "UnsupportedError",
            "StreamedParameterError",
        ],
        ".io.handle": ["AsyncIOHandle"],
        ".io.request": ["Request"],
        ".pending": ["Pending"],
        ".io.buffers": ["aligned_empty", "is_aligned", "is_pinned"],
        ".config": ["AioConfig"],
        ".swap.config": ["SwapConfig"],
        ".swap.tensor_swapper": ["TensorSwapper", "SwapIn", "SwapOut"],
        ".swap.optimizer": ["OffloadedOptimizer"],
        ".swap.params": ["offload_parameters", "ParameterOffload", "OffloadStats", "find_blocks"],
        ".swap.params.options": ["LoadOptions", "TrainOptions", "StreamOptions"],
        ".integrations.hugging_face.pretrained": ["from_pretrained"],
        ".integrations.hugging_face.trainer": ["trainer_arguments"],
        ".activations": ["offload_activations", "ActivationOffload"],
        ".kv": ["StorageCache"],
        ".checkpoint.api": ["save", "save_async", "load"],
        ".op_builder": ["BuildError"],
    },
    eager=["__version__"],
)

if TYPE_CHECKING:
    from .activations import ActivationOffload, offload_activations
    from .checkpoint.api import load, save, save_async
    from .config import AioConfig
    from .errors import (
        CheckpointError,
        CheckpointNotFoundError,
        ChecksumError,
        ClosedError,
        ConfigError,
        DeepOffloadError,
        MemoryBudgetError,
        ResidencyError,
        StreamedParameterError,
        UnsupportedError,
        ValidationError,
    )
    from .integrations.hugging_face.pretrained import from_pretrained
    from .integrations.hugging_face.trainer import trainer_arguments
    from .io.buffers import aligned_empty, is_aligned, is_pinned
    from .io.handle import AsyncIOHandle
    from .io.request import Request
    from .kv import StorageCache
    from .op_builder import BuildError
    from .pending import Pending
    from .swap.config import SwapConfig
    from .swap.optimizer import OffloadedOptimizer
    from .swap.params import OffloadStats, ParameterOffload, find_blocks, offload_parameters
    from .swap.params.options import LoadOptions, StreamOptions, TrainOptions
    from .swap.tensor_swapper import SwapIn, SwapOut, TensorSwapper
