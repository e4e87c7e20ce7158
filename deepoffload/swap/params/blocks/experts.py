"""``ExpertReads``: an inference forward reads the experts its router chose, not the whole experts module.

A Mixture-of-Experts block's experts module holds fused parameters whose first dimension is the expert
(``gate_up_proj[e]``, ``down_proj[e]``); each expert's bytes are a contiguous slice of the parameter's record. The model
rules name such modules (``ModelRules.experts``). Their parameters are the block's ``skip``: a forward without a
backward reads the block without them (``BlockStore.start_read(partial=True)``), and a pre-hook on the experts module
reads the chosen experts' slices (or takes them from the ``ExpertCache``) into their rows of whole-shaped parameters
(two slots of them, reused: no memory is allocated per forward; adjacent experts are one read), and the module's own
forward runs on them: the same call, which uses the chosen experts' rows only. Blocks read whole (training, the
backward's recompute, ``state_dict``) run the module untouched.

The early router: the next experts module's router, copied once its block was in memory, is applied to this module's
input before this module's own reads are waited for; the experts it chooses are read ahead into the next slot while
this module computes (speculative: a wrong guess costs a read, never a wrong result). The first module has no layer
before it: its experts are read when it runs (its router applied to the block's input guessed too few of them right to
pay for the bytes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ....io.buffers import aligned_empty
from ..storage.slices import read_slices
from .expert_cache import ExpertCache, ExpertStats
from .placeholders import plain, streamed
from .residency import Block, Residency


@dataclass(frozen=True)
class ExpertSet:
    """One experts module as the model rules describe it.

    Attributes:
        module: The experts module; called as ``module(hidden_states, top_k_index, top_k_weights)``.
        names: Its parameters whose first dimension is the expert (names in the module).
        count: The attribute holding its number of experts (an index equal to it is a padding one, skipped).
        router: The module choosing its experts (called on hidden states; an integer tensor of shape
            ``(tokens, top_k)`` in its output names them), or None.
    """

    module: nn.Module
    names: tuple[str, ...]
    count: str
    router: nn.Module | None = None


class _Experts:
    """One experts module's reads: its block, its parameters' names in the block, its router's copy."""

    def __init__(self, spec: ExpertSet, block: Block):
        self.spec, self.block = spec, block
        qualified = {id(p): n for n, p in zip(block.names, block.params)}
        self.params = [getattr(spec.module, n) for n in spec.names]
        self.names = [qualified[id(p)] for p in self.params]
        self.shapes = [block.shapes[block.names.index(n)] for n in self.names]  # (the parameters are placeholders)
        self.count = int(getattr(spec.module, spec.count))
        self.router_copy: nn.Module | None = None
        self.slot = 0  # which of the two buffers it computes in (``ExpertReads.buffers``)
        self.saved: list[torch.Tensor] = []


class ExpertReads:
    """Expert-granular reads of the blocks' experts modules, with a cache and an early router (module docstring).

    Args:
        blocks: The offload's blocks.
        store: Their ``BlockStore``.
        sets: The experts modules the model rules found.
        budget: Returns ``max_resident_bytes`` (None: 0); the expert cache holds what its pinned blocks leave.
    """

    def __init__(self, blocks: list[Block], store: Any, sets: list[ExpertSet], budget: Callable[[], int | None]):
        self.store = store
        self.stats = ExpertStats()
        pinned = lambda: sum(b.nbytes + b.compute_nbytes for b in blocks if b.state is Residency.PINNED)  # noqa: E731
        self.cache = ExpertCache(lambda: max(0, (budget() or 0) - pinned()), self.stats)
        self.pending: dict[int, tuple[_Experts, list[int], Callable[[], None]]] = {}  # slot -> rows read ahead
        self.slots: dict[tuple, list[torch.Tensor]] = {}
        self.experts: list[_Experts] = []
        self.handles: list[Any] = []
        self.stamps: dict[int, list[Any]] = {}  # block index -> its experts' records when last read
        for spec in sets:
            block = next((b for b in blocks if any(m is spec.module for m in b.module.modules())), None)
            if block is None or block.compute_dtype is not None:  # (compute copies: the block is read whole)
                continue
            entry = _Experts(spec, block)
            entry.slot = len(self.experts) % 2
            block.skip = block.skip | frozenset(entry.names)
            self.experts.append(entry)
            self.handles.append(spec.module.register_forward_pre_hook(self._before(entry), with_kwargs=True))
            self.handles.append(spec.module.register_forward_hook(self._after(entry), always_call=True))
            if spec.router is not None:
                self.handles.append(spec.router.register_forward_hook(self._copy_router(entry)))

    # -- hooks ----------------------------------------------------------------------------------------------
    def _copy_router(self, entry: _Experts) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if entry.router_copy is None and not any(t.is_meta for t in module.parameters()):
                with torch.no_grad():
                    entry.router_copy = copy.deepcopy(module).requires_grad_(False)

        return hook

    def _before(self, entry: _Experts) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not entry.block.read_partly:
                return  # read whole: the module runs on its own parameters
            values = [*args, *kwargs.values()]
            hidden, index = values[0], values[1]
            chosen = [e for e in torch.unique(index).tolist() if e < entry.count]
            tensors = self.take(entry, chosen, hidden)
            entry.saved = [p.data for p in entry.params]
            for param, value in zip(entry.params, tensors):
                plain(param)
                param.data = value

        return hook

    def _after(self, entry: _Experts) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not entry.saved:
                return
            for param, name, saved in zip(entry.params, entry.names, entry.saved):
                param.data = saved
                streamed(param, entry.block, name)
            entry.saved = []

        return hook

    # -- reading --------------------------------------------------------------------------------------------
    def buffers(self, entry: _Experts) -> list[torch.Tensor]:
        """The module's slot: whole-shaped parameters (zeroed once) whose chosen experts' rows a forward fills.

        Experts modules alternate between two slots, so the next one's experts are read while this one computes.

        Args:
            entry: The experts module.

        Returns:
            One tensor per parameter, of the parameter's shape and dtype (reused by every module of that slot).
        """
        key = (entry.slot, tuple(entry.shapes), tuple(p.dtype for p in entry.params))
        if key not in self.slots:
            self.slots[key] = [aligned_empty(s, p.dtype, pin=False).zero_() for p, s in zip(entry.params, entry.shapes)]
        return self.slots[key]

    def take(self, entry: _Experts, chosen: list[int], hidden: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The module's parameters with the ``chosen`` experts' rows as stored (cached, read ahead or read now).

        The other rows hold other experts' values (or zeros): the module's forward, called with ``chosen`` only,
        never uses them. The next experts module's reads are started (``prefetch_after``) before this one's are
        waited for.

        Args:
            entry: The experts module.
            chosen: Expert indices, ascending.
            hidden: The module's input (the early router's), or None.

        Returns:
            One tensor per parameter, of the parameter's shape.
        """
        self.check_stored(entry)
        out = self.buffers(entry)
        pending = self.pending.pop(entry.slot, None)
        if pending is not None and pending[0] is not entry:
            pending[2]()  # (another module's reads into this slot finish before its rows are written)
            pending = None
        ready = set(pending[1]) if pending is not None else set()
        missing, cached = [], []
        for e in chosen:
            found = self.cache.get((entry.block.index, e))  # (counts the use)
            if e in ready:
                self.stats.prefetch_used += 1
            elif found is not None:
                cached.append((e, found))
            else:
                missing.append(e)
        waits = [read_slices(self.store, entry.block, n, missing, t) for n, t in zip(entry.names, out)]
        if pending is not None:
            waits.insert(0, pending[2])  # (its rows and the missing ones are other rows of the slot)
        if hidden is not None:
            self.prefetch_after(entry, hidden)
        for e, found in cached:
            for tensor, part in zip(out, found):
                tensor[e].copy_(part)
        for wait in waits:
            wait()
        row = sum(t[0].numel() * t.element_size() for t in out)
        self.stats.misses += len(missing)
        self.stats.hits += len(chosen) - len(missing)
        self.stats.bytes_read += row * len(missing)
        if self.cache.budget() >= row:  # (copies only when the cache may keep them)
            for e in [*missing, *(e for e in chosen if e in ready)]:
                if (entry.block.index, e) not in self.cache:
                    self.cache.put((entry.block.index, e), [t[e].clone() for t in out])
        return out

    def settle(self, entry: _Experts) -> None:
        """Wait for the reads pending into ``entry``'s slot and drop them (the slot is read into again)."""
        pending = self.pending.pop(entry.slot, None)
        if pending is not None:
            pending[2]()

    def check_stored(self, entry: _Experts) -> None:
        """Drop what is cached or read ahead of ``entry``'s block when its records changed (it was written since)."""
        records = self.store.swapper.records(entry.block.group)
        stamp = [records[name] for name in entry.names]
        seen = self.stamps.get(entry.block.index)
        if seen is not None and all(a is b for a, b in zip(seen, stamp)):
            return
        self.stamps[entry.block.index] = stamp  # (held: the old records' ids are not reused while compared)
        for slot, (owner, _, wait) in list(self.pending.items()):
            if owner.block is entry.block:
                del self.pending[slot]
                wait()
        for key in [k for k in self.cache.entries if k[0] == entry.block.index]:
            self.cache.drop(key)

    def prefetch_after(self, entry: _Experts, hidden: torch.Tensor) -> None:
        """Start reading the experts the next experts module's router chooses for ``hidden`` (speculative)."""
        position = self.experts.index(entry)
        following = self.experts[position + 1] if position + 1 < len(self.experts) else None
        if following is not None and following.block is not entry.block:
            self.prefetch(following, hidden)

    def prefetch(self, following: _Experts, hidden: torch.Tensor) -> None:
        """Start reading the experts ``following``'s router copy chooses for ``hidden`` into its slot (speculative).

        Args:
            following: An experts module about to run.
            hidden: Hidden states of the tokens it will run on, or an earlier layer's (its router is applied).
        """
        if following.router_copy is None or not following.block.read_partly:
            return  # (its block is read whole, or not yet: it may be read whole)
        self.check_stored(following)
        with torch.no_grad():
            output = following.router_copy(hidden.reshape(-1, hidden.shape[-1]))
        found = [t for t in (output if isinstance(output, tuple) else (output,)) if not t.is_floating_point()]
        if not found:
            return  # a router returning logits only: nothing to read ahead
        self.settle(following)  # (a read still pending into its slot finishes first: its rows may be read again)
        cached = lambda e: (following.block.index, e) in self.cache  # noqa: E731
        rows = [e for e in torch.unique(found[-1]).tolist() if e < following.count and not cached(e)]
        if not rows:
            return
        out = self.buffers(following)
        waits = [read_slices(self.store, following.block, n, rows, t) for n, t in zip(following.names, out)]
        self.stats.bytes_read += sum(t[0].numel() * t.element_size() for t in out) * len(rows)
        self.stats.prefetched += len(rows)
        self.pending[following.slot] = (following, rows, _waiting(waits))

    def forget(self) -> None:
        """Drop cached and read-ahead experts (after the weights changed: a training step, a load)."""
        for _, _, wait in self.pending.values():
            wait()
        self.pending.clear()
        self.cache.clear()

    def close(self) -> None:
        """Remove the hooks and drop what is cached; the blocks are read whole from now on."""
        self.forget()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for entry in self.experts:
            entry.block.skip = entry.block.skip - set(entry.names)


def _waiting(waits: list[Callable[[], None]]) -> Callable[[], None]:
    def wait() -> None:
        for one in waits:
            one()

    return wait
