"""Chunk planning for ``OffloadedOptimizer``: consecutive parameters whose state fills one staging buffer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from .chunks import Chunk
from .optimizer_state import state_bytes
from .pool import PAGE_SIZE

if TYPE_CHECKING:
    from .config import SwapConfig
    from .tensor_swapper import TensorSwapper


class PlanOwner(Protocol):
    """What a ``ChunkPlanner`` reads of the pipeline it plans for (``ChunkPipeline`` is one)."""

    optimizer: torch.optim.Optimizer
    swapper: TensorSwapper
    config: SwapConfig
    per_parameter: bool

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups."""
        ...

    def name(self, param: torch.Tensor) -> str:
        """The swapper's group name of ``param``'s state."""
        ...


class ChunkPlanner:
    """An ``OffloadedOptimizer``'s chunk plans, made from its state's sizes and kept while they hold.

    Args:
        owner: The pipeline planned for.
    """

    def __init__(self, owner: PlanOwner):
        self.owner = owner
        self._plans: dict[tuple, list[Chunk]] = {}  # chunk plans made at ``_plans_version`` of the swapper
        self._plans_version = -1

    def estimate(self, param: torch.Tensor) -> int:
        """Bytes of staging buffer a parameter's state takes in a chunk.

        Args:
            param: The parameter.

        Returns:
            Its state's bytes (on storage, in memory, or before its first step a guess of two copies of the
            parameter), with the alignment padding of each of its tensors.
        """
        swapper = self.owner.swapper
        state = self.owner.optimizer.state.get(param)
        resident = [v for v in state.values() if isinstance(v, torch.Tensor)] if state else []
        name = self.owner.name(param)
        count = len(resident) + len(swapper.records(name)) if swapper.has(name) else len(resident)
        nbytes = swapper.stored_bytes(name) + sum(state_bytes(v) for v in resident)
        if not nbytes:
            nbytes, count = 2 * state_bytes(param), 3
        return nbytes + swapper.tensor_alignment * count

    def plan(self, params: list[torch.Tensor]) -> list[Chunk]:
        """Split ``params`` into chunks of consecutive parameters whose state fills at most one pooled buffer.

        A buffer holds ``chunk_bytes`` less a page for the extent's padding, so a step's buffers come from the
        bounded pool; when one parameter's state is larger, chunks hold up to it plus a sixteenth and the pool's
        buffers grow to the fullest chunk. The plan is reused while the same parameters (in the same param groups)
        are stepped and no stored state changed size or place.

        Args:
            params: The parameters to step, in order.

        Returns:
            The chunks, in order.
        """
        owner = self.owner
        version = owner.swapper.version
        if version != self._plans_version:
            self._plans, self._plans_version = {}, version
        key = (tuple(map(id, params)), tuple((id(g["params"]), len(g["params"])) for g in owner.param_groups))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        estimates = [self.estimate(param) for param in params]
        if not owner.per_parameter:  # one chunk: the wrapped optimizer's step sees every parameter at once
            whole = Chunk(params)
            owner.swapper.pool.fit(sum(estimates) + PAGE_SIZE)
            return self._keep(key, [whole])
        # A parameter whose state exceeds chunk_bytes would need a fresh buffer each step, made on the step's thread
        # and faulted in during the read (O_DIRECT reads into fresh 4 KiB pages: 0.4-1.0 GB/s here, into faulted-in
        # ones 2.3 GB/s): the pool's buffers grow to hold it instead (with a sixteenth to spare, so the small
        # parameters beside it, e.g. its bias, travel in its chunk rather than taking a buffer of their own), and
        # chunks fill them.
        largest = max(estimates, default=0)
        budget = max(
            1,
            owner.config.chunk_bytes - PAGE_SIZE,
            owner.swapper.pool.buffer_bytes - PAGE_SIZE,
            largest + largest // 16 if largest > owner.config.chunk_bytes - PAGE_SIZE else 0,
        )
        chunks: list[Chunk] = []
        size = fullest = 0
        for param, nbytes in zip(params, estimates):
            if not chunks or size + nbytes > budget:
                chunks.append(Chunk())
                size = 0
            chunks[-1].append(param)
            size += nbytes
            fullest = max(fullest, size)
        owner.swapper.pool.fit(fullest + PAGE_SIZE)
        return self._keep(key, chunks)

    def _keep(self, key: tuple, chunks: list[Chunk]) -> list[Chunk]:
        """Name the chunks' parameters and keep the plan for reuse.

        Returns:
            ``chunks``.
        """
        owner = self.owner
        for chunk in chunks:
            chunk.names = [owner.name(p) for p in chunk]
            chunk.by_name = dict(zip(chunk.names, chunk))
        if len(self._plans) >= 8:  # a few plans (e.g. step, state_dict, step_in_backward's): bounded
            self._plans.clear()
        self._plans[key] = chunks
        return chunks


def index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    parts: list[list[int]] = []  # [first, last] of each run
    for i in indices:
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) or "none"
