"""Helpers of the activation-offload tests: a config small enough for tests, and a step run with and without it."""

from __future__ import annotations

from typing import Callable

import torch

from deepoffload import SwapConfig, offload_activations

CHUNK = 64 << 10  # small checksum chunks and write bound: every stored tensor here spans several


def config(**changes) -> SwapConfig:
    """At most 4 x 64 KiB being written, checksums per 64 KiB, unpinned (tests need no memlock)."""
    return SwapConfig(chunk_bytes=CHUNK, buffer_count=4, pin=False).replace(**changes)


def grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    """Clones of the parameters' gradients, then cleared."""
    out = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def same(a: list, b: list) -> bool:
    """Both lists hold the same gradients bit for bit (and None at the same places)."""
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y))
        for x, y in zip(a, b)
    )


def plain_and_offloaded(model: torch.nn.Module, step: Callable[[], None], folder, **kwargs):
    """Gradients of ``step()`` run plainly, then inside ``offload_activations`` (min_bytes=0 by default).

    Returns:
        (plain gradients, offloaded gradients, the offload's stats).
    """
    step()
    plain = grads(model)
    kwargs.setdefault("min_bytes", 0)
    kwargs.setdefault("config", config())
    with offload_activations(str(folder), **kwargs) as off:
        step()
    return plain, grads(model), off.stats()
