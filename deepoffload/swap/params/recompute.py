"""Recomputation: a block runs inside an autograd function that keeps only its inputs; backward makes the block
resident again, recomputes it under the forward's RNG state and back-propagates through it.

The function talks to the streaming side through ``Streamer`` (make resident, release, what to do after a
forward and after a backward); it knows nothing of storage or optimizers."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import get_device_states, set_device_states

from .residency import Block


class Streamer(Protocol):
    def acquire(self, block: Block, phase: str, training: bool) -> None: ...
    def after_forward(self, block: Block, training: bool) -> None: ...
    def before_backward(self, block: Block) -> None: ...
    def after_backward(self, block: Block) -> None: ...
    def release(self, block: Block) -> None: ...


class BlockCall:
    """One call of a block: its non-tensor arguments, how to rebuild them, and its outputs' structure."""

    def __init__(self, streamer: Streamer, block: Block, forward: Callable, flat: list, spec: Any):
        self.streamer, self.block, self.forward = streamer, block, forward
        self.flat, self.spec = flat, spec
        self.positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        self.out_flat: list = []
        self.out_spec: Any = None
        self.out_positions: list[int] = []
        self.rng: tuple | None = None

    def run(self, tensors: Sequence[torch.Tensor]) -> Any:
        flat = list(self.flat)
        for position, tensor in zip(self.positions, tensors):
            flat[position] = tensor
        args, kwargs = pytree.tree_unflatten(flat, self.spec)
        return self.forward(*args, **kwargs)

    def rebuild(self, outputs: Sequence[torch.Tensor]) -> Any:
        flat = list(self.out_flat)
        for position, tensor in zip(self.out_positions, outputs):
            flat[position] = tensor
        return pytree.tree_unflatten(flat, self.out_spec)


def detached(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().requires_grad_(t.requires_grad) for t in tensors]


def _device_type(tensors: Sequence[torch.Tensor]) -> str:
    return next((t.device.type for t in tensors if t.device.type != "cpu"), "cuda")


class Recompute(torch.autograd.Function):
    """Runs a block keeping only its inputs; backward re-reads its parameters and recomputes it."""

    @staticmethod
    def forward(ctx, call: BlockCall, token: torch.Tensor, *tensors: torch.Tensor):
        # token requires grad, so the outputs do even when no input does (the parameters are not inputs here)
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors)
        device_type = _device_type(tensors)
        call.rng = (torch.get_rng_state(), *get_device_states(*tensors), device_type)
        streamer, block = call.streamer, call.block
        streamer.acquire(block, "forward", training=True)
        try:
            with torch.enable_grad():  # the same grad mode, hence the same kernels, as the in-memory model
                flat, call.out_spec = pytree.tree_flatten(call.run(detached(tensors)))
            call.out_positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
            call.out_flat = [None if isinstance(x, torch.Tensor) else x for x in flat]
            outputs = tuple(flat[i].detach() for i in call.out_positions)
            del flat  # the graph (and its views of the parameters) goes before the parameters are released
        finally:
            streamer.after_forward(block, training=True)
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        block.pending_backward += 1
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        call: BlockCall = ctx.call
        streamer, block = call.streamer, call.block
        inputs = detached(ctx.saved_tensors)
        streamer.acquire(block, "backward", training=True)
        try:
            streamer.before_backward(block)
            cpu_state, devices, states, device_type = call.rng
            with torch.random.fork_rng(devices=devices, device_type=device_type):
                torch.set_rng_state(cpu_state)
                set_device_states(devices, states, device_type=device_type)
                with torch.enable_grad():
                    flat, _ = pytree.tree_flatten(call.run(inputs))
            pairs = [(flat[i], g) for i, g in zip(call.out_positions, grads)
                     if g is not None and flat[i].requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            del flat, pairs
        except BaseException:
            streamer.release(block)
            raise
        streamer.after_backward(block)
        return (None, None, *[t.grad if t.requires_grad else None for t in inputs])
