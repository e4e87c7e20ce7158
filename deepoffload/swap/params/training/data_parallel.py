"""Data-parallel streaming: ``TrainOptions(optimizer, data_parallel=True or a ProcessGroup)``.

Every rank streams the whole model from its own storage and gradients are averaged across the ranks with DDP's
arithmetic.

- At setup the parameters and buffers in memory are broadcast from the group's first rank, as DDP does at
  construction (a model built on ``meta`` must load every value from a checkpoint, the same on every rank).
- Before each forward of the module, its buffers are broadcast from the first rank (DDP's ``broadcast_buffers``).
- A block's gradients are averaged inside its backward, once they are complete and before the fused step (or,
  in grads mode, after they are added to those stored by earlier passes and before they are written, as DDP
  reduces the accumulated ``param.grad``; there the reduction runs during the next block's backward and the
  averages are written after it). Parameters outside the blocks are averaged at the end of each backward.
- Averaging is DDP's: each gradient multiplied by ``1 / world_size`` while copied into a flat bucket (one dtype,
  at most ``BUCKET_BYTES``), the bucket summed by ``all_reduce``, the results copied back. On 2 ranks this is bit
  for bit what DDP in memory computes; with more ranks the backend's summation order may differ from DDP's by
  the bucket layout.
- A gradient present on some ranks but not all (different computations per rank) raises on every rank, naming the
  parameter, instead of hanging in a mismatched collective; so do ranks averaging different blocks at the same time
  (a block skipped on some ranks), whose collectives could otherwise match in size and silently mix the blocks.

Every rank must run the same blocks in the same order in each backward, as DDP (without
``find_unused_parameters``) requires.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Callable, Iterator, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from ....errors import UnsupportedError

BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


def process_group(data_parallel: object):
    """The process group ``data_parallel=`` names; not called for ``data_parallel=False``.

    Args:
        data_parallel: True (the default group) or a ``ProcessGroup``.

    Returns:
        The group, or None for the default group.

    Raises:
        UnsupportedError: When torch.distributed is not initialized.
        TypeError: When ``data_parallel`` is neither True nor a ``ProcessGroup``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise UnsupportedError(
            "TrainOptions(data_parallel=...): torch.distributed is not initialized: call "
            "torch.distributed.init_process_group() first (torchrun sets its environment)"
        )
    if data_parallel is True:
        return None
    if isinstance(data_parallel, dist.ProcessGroup):
        return data_parallel
    raise TypeError(
        f"data_parallel=: expected True, False or a torch.distributed.ProcessGroup, got {type(data_parallel).__name__}"
    )


def _buckets(grads: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``grads`` grouped in order into buckets of one dtype and device, at most BUCKET_BYTES each.

    Args:
        grads: The gradients to average.

    Returns:
        The buckets, each a list of indices (a gradient larger than BUCKET_BYTES gets a bucket of its own).
    """
    buckets: list[list[int]] = []
    size = 0
    for k, g in enumerate(grads):
        nbytes = g.numel() * g.element_size()
        last = grads[buckets[-1][-1]] if buckets else None
        if last is None or last.dtype != g.dtype or last.device != g.device or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(k)
        size += nbytes
    return buckets


def control_device(group) -> torch.device:
    """Where the group's small check tensors go, as torch places those of its object collectives.

    The CPU when the group has a CPU backend (gloo), else the current device of the group's device type (NCCL
    reduces CUDA tensors only).

    Args:
        group: The process group (None: the default group).

    Returns:
        The device.
    """
    pg = group if group is not None else dist.group.WORLD
    types = [d.type for d in getattr(pg, "_device_types", ())]  # (torch's own list of what the group reduces)
    if not types or "cpu" in types:
        return torch.device("cpu")
    module = getattr(torch, types[0], None)
    current = getattr(module, "current_device", None)
    return torch.device(types[0], current()) if callable(current) else torch.device(types[0])


class GradientAverager:
    """Averages named gradients across the ranks of ``group`` (None: the default group).

    Args:
        group: The process group.
    """

    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.device = control_device(group)

    def average(self, named: Sequence[tuple[str, torch.Tensor | None]], where: str) -> list[torch.Tensor | None]:
        """The averages of ``named`` gradients, in order (None where no rank has one).

        Args:
            named: (name, gradient or None) pairs, the same names in the same order on every rank.
            where: What is averaged, for the error message.

        Returns:
            The averages, in order.
        """
        return self.start(named, where)()

    def start(
        self, named: Sequence[tuple[str, torch.Tensor | None]], where: str
    ) -> Callable[[], list[torch.Tensor | None]]:
        """Check which gradients exist on every rank and start averaging them.

        The gradients are copied into the buckets here: they may be freed.

        Args:
            named: (name, gradient or None) pairs, the same names in the same order on every rank.
            where: What is averaged, for the error message.

        Returns:
            The call that waits for the averages (``average``'s result).

        Raises:
            UnsupportedError: When a gradient exists on some ranks but not all (named, on every rank), or other
                ranks are averaging something else (another block) in the same collective.
        """
        # One MAX all_reduce of [flags, -flags, tag, -tag]: max(flags) says whether any rank has each gradient,
        # -max(-flags) whether every rank has it, and the tag (what is averaged) must be the same on every rank.
        flags = [int(g is not None) for _, g in named]
        tag = zlib.crc32(where.encode())
        check = torch.tensor([*flags, *(-f for f in flags), tag, -tag], dtype=torch.int64, device=self.device)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=self.group)
        check = check.cpu()
        n = len(flags)
        if int(check[-2]) != -int(check[-1]):
            raise UnsupportedError(
                f"{where}: other ranks are averaging something different at the same time: the ranks "
                f"back-propagated different blocks (a block skipped on some ranks, as LayerDrop or an early exit "
                f"does), so their gradients cannot be averaged as DistributedDataParallel would. Every rank "
                f"must run the same blocks in the same order in each backward"
            )
        uneven = [name for k, (name, _) in enumerate(named) if check[k] == 1 and check[n + k] == 0]
        if uneven:
            raise UnsupportedError(
                f"{where}: the gradients of {', '.join(uneven[:5])} exist on some ranks but not on "
                f"others: the ranks ran different computations, so they cannot be averaged as "
                f"DistributedDataParallel would. Every rank must use the same parameters in each "
                f"backward"
            )
        grads = [g for _, g in named if g is not None]
        averaged: list[torch.Tensor] = [None] * len(grads)  # type: ignore[list-item]
        scale = 1.0 / self.world
        flats, works = [], []
        for bucket in _buckets(grads):  # each bucket reduced while the next is filled
            members = [grads[k] for k in bucket]
            flat = torch.empty(sum(g.numel() for g in members), dtype=members[0].dtype, device=members[0].device)
            offset = 0
            for g in members:  # DDP: mul_out(bucket_view, grad, 1 / world_size)
                torch.mul(g.reshape(-1), scale, out=flat[offset : offset + g.numel()])
                offset += g.numel()
            flats.append(flat)
            works.append(dist.all_reduce(flat, group=self.group, async_op=True))
        layout = [[(k, grads[k].shape, grads[k].numel()) for k in bucket] for bucket in _buckets(grads)]
        has_grad = [g is not None for _, g in named]
        del grads  # the buckets hold copies: the caller may free its gradients

        def finish() -> list[torch.Tensor | None]:
            for bucket, flat, work in zip(layout, flats, works):
                work.wait()
                offset = 0
                for k, shape, numel in bucket:
                    averaged[k] = flat[offset : offset + numel].view(shape)
                    offset += numel
            it = iter(averaged)
            return [next(it) if has else None for has in has_grad]

        return finish

    def average_dict(self, names: Sequence[str], grads: dict[str, torch.Tensor], where: str) -> dict:
        """``grads`` (by name, a subset of ``names``) averaged: the same keys, new tensors."""
        return self.start_dict(names, grads, where)()

    def start_dict(self, names: Sequence[str], grads: dict[str, torch.Tensor], where: str) -> Callable[[], dict]:
        """``average_dict`` started: returns the call that waits for its result."""
        finish = self.start([(n, grads.get(n)) for n in names], where)
        return lambda: {n: v for n, v in zip(names, finish()) if v is not None}

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` from the group's first rank into every rank's (in place; empty ones are skipped)."""
        for t in tensors:
            if t.numel():
                dist.broadcast(t.data, self.src, group=self.group)


class DataParallel:
    """What ``ParameterOffload`` uses under ``data_parallel=``.

    It averages block gradients (``average_block``) and the parameters outside blocks at the end of each backward,
    and broadcasts buffers before each forward.

    Args:
        group: The process group (None: the default group).
        module: The model, whose buffers are broadcast before each forward.
        rest: The parameters outside blocks.
        rest_names: Their names, in the same order.
    """

    def __init__(self, group, module: nn.Module, rest: Sequence[nn.Parameter], rest_names: Sequence[str]):
        self.averager = GradientAverager(group)
        self.module = module
        self.rest = list(rest)
        self.rest_names = list(rest_names)
        # _average_rest is queued on the backward under way. Reset by that callback, and by the module's next forward:
        # a backward that raised never runs its callbacks, and the flag it left set would stop every later backward
        # from queuing one. Not per graph task: a block under a reentrant checkpoint back-propagates in a nested
        # one, which must not average the parameters outside the blocks again
        self._queued = False
        self._local = False  # inside rank_local(): forwards on this rank alone, no collective
        self._handles = [p.register_post_accumulate_grad_hook(self._rest_ready) for p in self.rest if p.requires_grad]
        self._handles.append(module.register_forward_pre_hook(self._broadcast_buffers))

    def average_block(self, block, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The block's complete gradients (master dtype, by name) averaged across the ranks."""
        return self.start_block(block, grads)()

    @contextlib.contextmanager
    def rank_local(self) -> Iterator[None]:
        """Forwards on this rank alone, as DDP's ``ddp.module(...)``: no buffer broadcast, no backward.

        See ``ParameterOffload.rank_local``.
        """
        self._local = True
        try:
            yield
        finally:
            self._local = False

    def _refuse_local_backward(self, what: str) -> None:
        if self._local:
            raise UnsupportedError(
                f"{what}: a backward inside ParameterOffload.rank_local(): its gradients would have to be averaged "
                f"with ranks that are not running it. rank_local() is for forwards on one rank (evaluation); run "
                f"training steps outside it, on every rank"
            )

    def start_block(self, block, grads: dict[str, torch.Tensor]) -> Callable[[], dict[str, torch.Tensor]]:
        """``average_block`` started: returns the call that waits for its result."""
        self._refuse_local_backward(f"block {block.prefix}")
        names = [n for n, m in zip(block.names, block.masters) if m.requires_grad]
        return self.averager.start_dict(names, grads, f"block {block.prefix}")

    def end_of_backward_pending(self) -> None:
        """Have the parameters outside blocks averaged when the backward under way ends (once per backward).

        Called from inside a backward: a block's, or a hook of a parameter outside the blocks.
        """
        self._refuse_local_backward("the parameters outside the blocks")
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average_rest)

    def _rest_ready(self, param: torch.Tensor) -> None:
        self.end_of_backward_pending()

    def _average_rest(self) -> None:
        self._queued = False
        named = [(n, p.grad) for n, p in zip(self.rest_names, self.rest) if p.requires_grad]
        if not named:  # the same on every rank (one model)
            return
        values = self.averager.average(named, "the parameters outside the blocks")
        params = [p for p in self.rest if p.requires_grad]
        with torch.no_grad():
            for param, value in zip(params, values):
                if value is not None:  # an average exists only where every rank (this one too) had a gradient
                    cast(torch.Tensor, param.grad).copy_(value)

    def _broadcast_buffers(self, module: nn.Module, args) -> None:
        if torch._C._current_graph_task_id() == -1:  # a new forward, outside any backward: none is queued now
            self._queued = False
        if not self._local:
            self.averager.broadcast(list(module.buffers()))

    def close(self) -> None:
        """Remove the hooks (gradients and buffers are no longer averaged or broadcast)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
