"""Recomputation: a block runs inside an autograd function that keeps only its inputs.

Backward makes the block resident again, recomputes it under the forward's autocast, RNG state and kernel settings
(``forward_state``), buffers and cache state (``side_effects``), and back-propagates through it.

Which backward is a block's last in a pass (when its gradients are complete) is asked of the autograd engine: the
block's other pending calls that the running backward will still execute. Calls whose graph is never back-propagated
(a validation forward without ``torch.no_grad()``, the forward that ``torch.utils.checkpoint`` recomputes) are
simply dropped with their graph.

The function talks to the streaming side through ``Streamer``; it knows nothing of storage or optimizers.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol, Sequence, cast

import torch
from torch.utils import _pytree as pytree

from ....errors import UnsupportedError
from ..blocks.residency import Block
from .forward_state import ForwardState
from .side_effects import Captured, check_caches


class Streamer(Protocol):
    """The streaming side ``Recompute`` talks to (``ParameterOffload``, whose methods these are)."""

    mode: str  # the training mode, "fused" or "grads"
    keep_graphs: bool  # frozen blocks keep their forward's graph for backward (StreamOptions(recompute=False))

    def acquire(self, block: Block, phase: str, training: bool) -> None:
        """Make ``block`` resident and read ahead the blocks expected next."""
        ...

    def after_forward(self, block: Block, training: bool) -> None:
        """Release ``block`` after its forward unless it is expected again soon."""
        ...

    def before_backward(self, call: "BlockCall", last: bool) -> bool:
        """Check the backward of ``call`` may run; return whether the block's gradients are complete after it."""
        ...

    def after_backward(self, block: Block, last: bool) -> None:
        """Hand complete gradients on (``last``), else keep them; release the block."""
        ...

    def release(self, block: Block) -> None:
        """Release ``block``'s memory."""
        ...


class BlockCall:
    """One call of a block: its arguments, its outputs' structure, and what recomputation needs.

    It holds the non-tensor arguments and how to rebuild them, the outputs' structure, and what recomputation needs:
    the forward's autocast, RNG and settings, the state before the forward, the block's step count at the forward.

    Args:
        streamer: The streaming side.
        block: The block called.
        forward: The block's own forward.
        flat: The call's arguments, flattened (``pytree``).
        spec: Their structure.
    """

    def __init__(self, streamer: Streamer, block: Block, forward: Callable, flat: list, spec: Any):
        self.streamer, self.block, self.forward = streamer, block, forward
        self.positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        self.flat = [None if isinstance(x, torch.Tensor) else x for x in flat]
        self.spec = spec
        self.out_flat: list = []
        self.out_spec: Any = None
        self.out_positions: list[int] = []
        self.chained: list[int] = []  # the tensor inputs also returned as aliases (``shared_inputs``)
        self.was_leaf = [t.is_leaf for t in flat if isinstance(t, torch.Tensor)]  # (the tensors the caller gave)
        self.state: ForwardState | None = None
        self.captured = Captured(block.module, check_caches(block.prefix, flat))
        self.steps = block.steps
        self.node: weakref.ref | None = None  # the autograd node (ctx) of this call
        self.kept: KeptGraph | None = None  # the forward's graph, kept for backward (frozen blocks, keep_graphs)
        # made inside a backward pass (a reentrant torch.utils.checkpoint recomputing its segment): such a call is
        # back-propagated in a nested pass of its own, which cannot see the block's other calls still to come
        self.nested = torch._C._current_graph_task_id() != -1

    def run(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Call the block's forward with the call's arguments, its tensors replaced by ``tensors``.

        Args:
            tensors: The tensor arguments, in order.

        Returns:
            The forward's result.
        """
        flat = list(self.flat)
        for position, tensor in zip(self.positions, tensors):
            flat[position] = tensor
        args, kwargs = pytree.tree_unflatten(flat, self.spec)
        return self.forward(*args, **kwargs)

    def rebuild(self, outputs: Sequence[torch.Tensor]) -> Any:
        """The forward's result in its structure, its tensors replaced by ``outputs``.

        Args:
            outputs: The tensor outputs, in order.

        Returns:
            The result as the forward returned it.
        """
        flat = list(self.out_flat)
        for position, tensor in zip(self.out_positions, outputs):
            flat[position] = tensor
        return pytree.tree_unflatten(flat, self.out_spec)

    def will_run_backward(self) -> bool:
        """Whether this call's backward is still to run in the backward pass under way."""
        node = self.node() if self.node is not None else None
        return node is not None and torch._C._will_engine_execute_node(node)


class _Saved:
    """A tensor the autograd graph saved (weakly referenced: it dies with the graph).

    ``stale``: the graph outlived the block's forward (see ``Recompute.forward``); unpacking it, i.e. back-propagating
    through it, raises.

    Args:
        tensor: The saved tensor.
    """

    __slots__ = ("tensor", "stale", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.stale = ""


def _unpack(holder: _Saved) -> torch.Tensor:
    if holder.stale:
        raise ValueError(holder.stale)
    return holder.tensor


def _watched(saved: list) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that record a weak reference to each tensor the graph built meanwhile saves."""

    def pack(tensor: torch.Tensor) -> _Saved:
        holder = _Saved(tensor.detach())  # (a saved output holding its own grad_fn would make a reference cycle)
        saved.append(weakref.ref(holder))
        return holder

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


class _ParamView:
    """A saved tensor that is a view of one of the block's parameters: re-made from the parameter when unpacked.

    Args:
        kept: The gate of the graph it belongs to (unpacked only while its backward runs, the block resident).
        index: The parameter's position in ``block.params``.
        tensor: The saved view.
        param: The parameter it views.
    """

    __slots__ = ("kept", "index", "size", "stride", "offset", "dtype")

    def __init__(self, kept: "_Gate", index: int, tensor: torch.Tensor, param: torch.Tensor):
        self.kept, self.index, self.dtype = kept, index, tensor.dtype
        self.size, self.stride = tensor.size(), tensor.stride()
        self.offset = (tensor.data_ptr() - param.data_ptr()) // tensor.element_size()

    def unpack(self) -> torch.Tensor:
        if not self.kept.unpacking:
            raise UnsupportedError(
                f"block {self.kept.block.prefix}: its forward's graph was back-propagated outside its own backward "
                "(a tensor computed inside the block outlived its forward other than as its output); train with "
                "StreamOptions(recompute=True)"
            )
        param = self.kept.block.params[self.index].detach()
        return param.as_strided(self.size, self.stride, param.storage_offset() + self.offset)


class _Gate:
    """Whether a kept graph's backward runs now (its block resident); holds no tensor, so no reference cycle."""

    __slots__ = ("block", "unpacking")

    def __init__(self, block: Block):
        self.block, self.unpacking = block, False


class KeptGraph:
    """The graph a frozen block's forward built, kept for its backward instead of recomputing the forward.

    The activations it saved stay in memory (as in memory); the saved tensors that view the block's parameters are
    kept as their position only and re-made from the parameters when the backward makes the block resident again.
    This sees what autograd saves (torch's ops, ``save_for_backward``), as the recomputing path's check does.

    Args:
        block: The block.
    """

    def __init__(self, block: Block):
        self.block = block
        self.gate = _Gate(block)
        self.inputs: list[torch.Tensor] = []  # the forward's leaves (their .grad: the inputs' gradients)
        self.given: list[torch.Tensor] = []  # what the block ran on (``as_given``)
        self.outputs: list[torch.Tensor] = []  # its tensor outputs, attached to the graph
        self.spans = [(p.data_ptr(), p.data_ptr() + p.nbytes, p) for p in block.params]
        self.storages = {p.untyped_storage().data_ptr() for p in block.params if p.numel()}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks: a view of a parameter is kept as its position, any other tensor as itself.

        The pack hook raises ``UnsupportedError`` when a saved tensor shares a parameter's memory other than as a view
        of one parameter of its dtype (it could not be re-made, and that memory is reused once the block is
        released).

        Returns:
            The hooks, a context manager.
        """

        def pack(tensor: torch.Tensor) -> Any:
            if not tensor.numel() or tensor.untyped_storage().data_ptr() not in self.storages:
                return tensor.detach()
            start = tensor.data_ptr()
            for index, (low, high, param) in enumerate(self.spans):
                if low <= start < high and tensor.dtype == param.dtype:
                    return _ParamView(self.gate, index, tensor, param)
            raise UnsupportedError(
                f"block {self.block.prefix}: its forward saved a tensor sharing its parameters' memory that is not "
                "a view of one parameter; train with StreamOptions(recompute=True)"
            )

        def unpack(packed: Any) -> torch.Tensor:
            return packed.unpack() if isinstance(packed, _ParamView) else packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def detached(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` detached, each requiring grad as it did."""
    return [t.detach().requires_grad_(t.requires_grad) for t in tensors]


def as_given(leaves: Sequence[torch.Tensor], was_leaf: Sequence[bool]) -> list[torch.Tensor]:
    """The block's inputs as in memory: a detached input requiring grad that was not a leaf there gets a view.

    A detached input requiring grad is a leaf, so autocast would cache its cast (it caches those of leaves requiring
    grad: in memory each use of T5's encoder output in a decoder block casts it again, and each cast's gradient is
    added in fp32, not once in bf16); the view prevents that. Call under grad mode.

    Args:
        leaves: The detached inputs.
        was_leaf: Whether each was a leaf in the caller's graph.

    Returns:
        The inputs to run the block on.
    """
    return [t.view_as(t) if t.requires_grad and not leaf else t for t, leaf in zip(leaves, was_leaf)]


def check_loss_scaling(block: Block, state: ForwardState, mode: str) -> None:
    """Refuse training a block under float16 autocast in fused mode.

    fp16 training needs a loss scaler (``torch.amp.GradScaler``) that unscales every gradient and skips the step when
    one is inf/NaN, before any parameter steps; fused mode steps the block inside its backward, before that. Grads
    mode keeps the gradients until ``step()``, where the scaler unscales and checks them (``training.scaling``).

    Args:
        block: The block called.
        state: Its forward's state (autocast).
        mode: The offload's training mode ("fused" or "grads").

    Raises:
        ValueError: When ``block`` has trainable parameters, autocast is on with float16 and ``mode`` is "fused".
    """
    half = [d for d, dtype in state.autocast_enabled.items() if dtype == torch.float16]
    if half and block.trainable and mode != "grads":
        raise ValueError(
            f"block {block.prefix}: training streamed blocks under torch.autocast({half[0]!r}, "
            f'dtype=torch.float16) in mode="{mode}" is not supported: fp16 needs a GradScaler, which must unscale '
            f"and check every gradient for inf/NaN before any parameter steps, and {mode} mode steps each block "
            f'inside its backward. Use offload_parameters(..., train=TrainOptions(optimizer, mode="grads")) '
            f"with scaler.step(StreamedOptimizer(off)) (exact, overflowing steps skipped), or bfloat16 "
            f"(torch.autocast(dtype=torch.bfloat16), compute_dtype=torch.bfloat16), which needs no GradScaler; fp16 "
            f"autocast works for inference (torch.no_grad()) and for frozen blocks"
        )


class Recompute(torch.autograd.Function):
    """Runs a block keeping only its inputs; backward re-reads its parameters and recomputes it."""

    @staticmethod
    def forward(ctx, call: BlockCall, token: torch.Tensor, *tensors: torch.Tensor):
        """Run the block on its resident parameters and keep only ``tensors``; return its outputs and the aliases."""
        # token requires grad, so the outputs do even when no input does (the parameters are not inputs here)
        ctx.call = call
        call.node = weakref.ref(ctx)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors)
        call.state = ForwardState.capture(tensors)
        streamer, block = call.streamer, call.block
        check_loss_scaling(block, call.state, streamer.mode)
        streamer.acquire(block, "forward", training=True)
        saved: list[weakref.ref] = []  # the tensors the block's graph saves, to see whether the graph outlives it
        kept = KeptGraph(block) if streamer.keep_graphs and block.module.training and not block.trainable else None
        try:
            with torch.enable_grad(), kept.hooks() if kept else _watched(saved):  # grad mode: the same kernels
                inputs = detached(tensors)
                given = as_given(inputs, call.was_leaf)
                flat, call.out_spec = pytree.tree_flatten(call.run(given))
            call.captured.detach_new_cache_entries()
            call.out_positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
            call.out_flat = [None if isinstance(x, torch.Tensor) else x for x in flat]
            outputs = tuple(flat[i].detach() for i in call.out_positions)
            if kept is not None:  # the backward runs this graph on the block read again: no recomputation
                kept.inputs, kept.given, kept.outputs = inputs, given, [flat[i] for i in call.out_positions]
                call.kept = kept
            del inputs, given
            # outputs needing no gradient in memory (a mask, a bias made of constants) need none here either: a
            # tensor requiring grad makes later blocks take other kernels (T5's cross-attention bias: rounding)
            constant = [o for i, o in zip(call.out_positions, outputs) if not flat[i].requires_grad]
            del flat  # the graph (and its views of the parameters) goes before the parameters are released
            stale = [h for h in (ref() for ref in saved) if h is not None]
            if stale:
                problem = (
                    f"block {block.prefix}: a tensor computed inside it outlives its forward other than as "
                    f"its output (e.g. transformers recording router logits or attention weights with hooks: "
                    f"output_router_logits=True, output_attentions=True); a backward through it would reach "
                    f"the block's parameters after they are released or stepped, so its gradients would be "
                    f"wrong. Train with those outputs off, or keep this module in memory (blocks= without it)"
                )
                if block.module.training:
                    raise ValueError(problem)
                for holder in stale:  # eval mode (a validation forward without no_grad): only its backward raises
                    holder.stale = problem
        finally:
            streamer.after_forward(block, training=True)
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())], *constant)
        block.calls.add(call)
        return outputs + tuple(tensors[k].detach() for k in call.chained)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        """Make the block resident again, recompute it as the forward ran and back-propagate ``grads`` through it."""
        call: BlockCall = ctx.call
        if call.kept is not None:
            return Recompute.backward_kept(call, grads)
        streamer, block = call.streamer, call.block
        inputs = detached(ctx.saved_tensors)  # (this may run torch.utils.checkpoint's recomputation first)
        block.calls.discard(call)
        last = not any(other.will_run_backward() for other in list(block.calls))
        last = streamer.before_backward(call, last)
        streamer.acquire(block, "backward", training=True)
        try:
            with call.captured.replay():  # (until the recomputed graph is done: it saved the buffers it read)
                with cast(ForwardState, call.state).restored():  # (set by this call's forward, which ran first)
                    given = as_given(inputs, call.was_leaf)
                    flat, _ = pytree.tree_flatten(call.run(given))
                n = len(call.out_positions)
                pairs = [
                    (flat[i], g)
                    for i, g in zip(call.out_positions, grads[:n])
                    if g is not None and flat[i].requires_grad
                ]
                # the gradient summed by later blocks for an input passed on to them: made last, so the engine adds
                # it into the input's gradient first, then this block's own uses (see shared_inputs)
                with torch.enable_grad():
                    pairs += [(given[k].view_as(given[k]), g) for k, g in zip(call.chained, grads[n:]) if g is not None]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                del flat, pairs, given
        except BaseException:
            streamer.release(block)
            raise
        streamer.after_backward(block, last)
        return (None, None, *[t.grad if t.requires_grad else None for t in inputs])

    @staticmethod
    def backward_kept(call: BlockCall, grads: Sequence[torch.Tensor | None]) -> tuple:
        """Make the block resident again and back-propagate ``grads`` through the graph its forward kept."""
        kept, call.kept = cast(KeptGraph, call.kept), None
        streamer, block = call.streamer, call.block
        block.calls.discard(call)
        last = not any(other.will_run_backward() for other in list(block.calls))
        last = streamer.before_backward(call, last)
        streamer.acquire(block, "backward", training=True)
        kept.gate.unpacking = True
        try:
            n = len(call.out_positions)
            pairs = [(o, g) for o, g in zip(kept.outputs, grads[:n]) if g is not None and o.requires_grad]
            with torch.enable_grad():  # (the chained inputs' gradient last, as in ``backward``)
                pairs += [
                    (kept.given[k].view_as(kept.given[k]), g) for k, g in zip(call.chained, grads[n:]) if g is not None
                ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            del pairs
        except BaseException:
            streamer.release(block)
            raise
        finally:
            kept.gate.unpacking = False
            kept.outputs, kept.given = [], []
        streamer.after_backward(block, last)
        return (None, None, *[t.grad if t.requires_grad else None for t in kept.inputs])
