"""The staging buffers an ``OffloadedOptimizer`` may hold under ``max_memory=``.

Its memory beyond the process: the gradients not yet made (the parameters' bytes), the optimizer's temporaries
(``TEMPORARIES`` x the largest parameter, as Adam's step makes them), ``buffer_count`` staging buffers of
``chunk_bytes`` each (a chunk holds at least the largest parameter's state, ``STATE_PER_PARAMETER`` times its bytes,
plus a sixteenth, as the optimizer grows its chunks), and 64 MiB for the forward's activations.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import MemoryBudgetError
from .config import SwapConfig
from .memory import limit_with_room
from .pool import round_up

MIN_BUFFERS = 3  # read ahead, step, write behind
STATE_PER_PARAMETER = 2  # Adam's two moments; an optimizer with more state grows its chunks past the plan
TEMPORARIES = 3
FORWARD_BYTES = 64 << 20


def fit_buffers(
    params: Sequence[torch.Tensor], limit: int, process: int, config: SwapConfig, whole: bool = False
) -> SwapConfig:
    """Lower ``config``'s ``buffer_count`` and ``chunk_bytes`` so that the process stays within ``limit`` bytes.

    Args:
        params: The optimizer's parameters.
        limit: The process's memory limit (bytes).
        process: The process's memory now (bytes).
        config: The config whose buffers are fitted.
        whole: The optimizer steps all parameters at once (``per_parameter=False``): its one chunk holds the whole
            state, planned as one parameter of all their bytes.

    Returns:
        ``config`` with ``buffer_count`` (at most its own, at least ``MIN_BUFFERS``) and ``chunk_bytes`` (at most its
        own, at least the largest parameter's state) that keep the process within ``limit``.

    Raises:
        MemoryBudgetError: When no such config exists; the message names the least limit that works and its parts.
    """
    sizes = [p.numel() * p.element_size() for p in params]
    largest = sum(sizes) if whole else max(sizes, default=0)
    grads = sum(n for n, p in zip(sizes, params) if p.grad is None and p.requires_grad)
    need_chunk = round_up(STATE_PER_PARAMETER * largest + STATE_PER_PARAMETER * largest // 16 + 1)
    fixed = process + grads + TEMPORARIES * largest + FORWARD_BYTES
    room = limit - fixed
    if room < MIN_BUFFERS * need_chunk:
        least = fixed + MIN_BUFFERS * need_chunk
        raise MemoryBudgetError(
            f"max_memory={limit} bytes ({limit / 1e6:.1f} MB) is too small for this optimizer: the "
            f"least that works is {least} bytes ({least / 1e6:.1f} MB): the process now "
            f"{process / 1e6:.1f} MB + gradients {grads / 1e6:.1f} MB + {TEMPORARIES} x the largest "
            f"parameter {largest / 1e6:.1f} MB (temporaries) + {MIN_BUFFERS} staging buffers of "
            f"{need_chunk / 1e6:.1f} MB (its state) + {FORWARD_BYTES / 1e6:.1f} MB for the forward. The process "
            f"grows as it runs: OffloadedOptimizer(..., max_memory={limit_with_room(least)!r}) leaves it room"
        )
    count = max(MIN_BUFFERS, min(config.buffer_count, room // need_chunk))
    chunk = max(need_chunk, min(config.chunk_bytes, room // count // 4096 * 4096))
    return config.replace(buffer_count=count, chunk_bytes=chunk)
