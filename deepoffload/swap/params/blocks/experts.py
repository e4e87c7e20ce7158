"""``ExpertReads``: an inference forward reads the experts its router chose, not the whole experts module.

A Mixture-of-Experts block's experts module holds fused parameters whose first dimension is the expert
(``gate_up_proj[e]``, ``down_proj[e]``); each expert's bytes are a contiguous slice of the parameter's record. The model
rules name such modules (``ModelRules.experts``). Their parameters are the block's ``skip``: a forward without a
backward reads the block without them (``BlockStore.start_read(partial=True)``), and a pre-hook on the experts module
reads the chosen experts' slices (or takes them from the ``ExpertCache``) into tensors of those experts only, and calls
the module's own forward with the expert indices renumbered into them and its expert count set to their number: the
same computation, expert by expert in the same order, as on the whole parameters. Blocks read whole (training, the
backward's recompute, ``state_dict``) run the module untouched.

The early router: the next experts module's router, copied once its block was in memory, is applied to this module's
input; the experts it chooses are read ahead (speculative: a wrong guess costs a read, never a wrong result).
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
        self.pending: dict[tuple[int, int], tuple[list[torch.Tensor], Callable[[], None]]] = {}
        self.experts: list[_Experts] = []
        self.handles: list[Any] = []
        self.stamps: dict[int, list[Any]] = {}  # block index -> its experts' records when last read
        for spec in sets:
            block = next((b for b in blocks if any(m is spec.module for m in b.module.modules())), None)
            if block is None or block.compute_dtype is not None:  # (compute copies: the block is read whole)
                continue
            entry = _Experts(spec, block)
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
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not entry.block.read_partly:
                return None  # read whole: the module runs on its own parameters
            values = [*args, *kwargs.values()]
            hidden, index = values[0], values[1]
            chosen = [int(e) for e in torch.unique(index) if int(e) < entry.count]
            tensors = self.take(entry, chosen)
            entry.saved = [p.data for p in entry.params]
            for param, value in zip(entry.params, tensors):
                plain(param)
                param.data = value
            setattr(module, entry.spec.count, len(chosen))
            lookup = torch.full((entry.count + 1,), len(chosen), dtype=index.dtype)
            lookup[torch.tensor(chosen, dtype=torch.long)] = torch.arange(len(chosen), dtype=index.dtype)
            renumbered = lookup[index.clamp(0, entry.count)]
            self.prefetch_after(entry, hidden)
            if len(args) >= 2:
                return (args[0], renumbered, *args[2:]), kwargs
            key = next(k for k, v in kwargs.items() if v is index)
            return args, {**kwargs, key: renumbered}

        return hook

    def _after(self, entry: _Experts) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not entry.saved:
                return
            setattr(module, entry.spec.count, entry.count)
            for param, name, saved in zip(entry.params, entry.names, entry.saved):
                param.data = saved
                streamed(param, entry.block, name)
            entry.saved = []

        return hook

    # -- reading --------------------------------------------------------------------------------------------
    def take(self, entry: _Experts, chosen: list[int]) -> list[torch.Tensor]:
        """The module's parameters holding only the ``chosen`` experts, in that order (cached, read ahead or read).

        Args:
            entry: The experts module.
            chosen: Expert indices, ascending.

        Returns:
            One tensor per parameter, of first dimension ``len(chosen)``.
        """
        self.check_stored(entry)
        out = [aligned_empty((len(chosen), *s[1:]), p.dtype, pin=False) for p, s in zip(entry.params, entry.shapes)]
        missing: dict[int, int] = {}
        for k, e in enumerate(chosen):
            key = (entry.block.index, e)
            found = self.cache.get(key)  # (counts the use)
            if key in self.pending:  # read ahead: used now, kept if the budget allows
                found, wait = self.pending.pop(key)
                wait()
                self.stats.prefetch_used += 1
                self.cache.put(key, found)
            if found is None:
                missing[k] = e
                self.stats.misses += 1
                continue
            self.stats.hits += 1
            for tensor, part in zip(out, found):
                tensor[k].copy_(part)
        if missing:
            waits = [
                read_slices(self.store, entry.block, name, entry.count, {e: t[k] for k, e in missing.items()})
                for name, t in zip(entry.names, out)
            ]
            for wait in waits:
                wait()
            self.stats.bytes_read += sum(t[0].numel() * t.element_size() for t in out) * len(missing)
            for k, e in missing.items():
                self.cache.put((entry.block.index, e), [t[k].clone() for t in out])
        return out

    def check_stored(self, entry: _Experts) -> None:
        """Drop what is cached or read ahead of ``entry``'s block when its records changed (it was written since)."""
        records = self.store.swapper.records(entry.block.group)
        stamp = [records[name] for name in entry.names]
        seen = self.stamps.get(entry.block.index)
        if seen is not None and all(a is b for a, b in zip(seen, stamp)):
            return
        self.stamps[entry.block.index] = stamp  # (held: the old records' ids are not reused while compared)
        for key in [k for k in self.pending if k[0] == entry.block.index]:
            self.pending.pop(key)[1]()
        for key in [k for k in self.cache.entries if k[0] == entry.block.index]:
            self.cache.drop(key)

    def prefetch_after(self, entry: _Experts, hidden: torch.Tensor) -> None:
        """Start reading the experts the next experts module's router chooses for ``hidden`` (speculative)."""
        position = self.experts.index(entry)
        following = self.experts[position + 1] if position + 1 < len(self.experts) else None
        if following is None or following.router_copy is None or following.block is entry.block:
            return
        self.check_stored(following)
        with torch.no_grad():
            output = following.router_copy(hidden)
        found = [t for t in (output if isinstance(output, tuple) else (output,)) if not t.is_floating_point()]
        if not found:
            return  # a router returning logits only: nothing to read ahead
        for e in sorted({int(e) for e in torch.unique(found[-1]) if int(e) < following.count}):
            key = (following.block.index, e)
            if key in self.cache or key in self.pending:
                continue
            parts = [aligned_empty(s[1:], p.dtype, pin=False) for p, s in zip(following.params, following.shapes)]
            waits = [
                read_slices(self.store, following.block, name, following.count, {e: t})
                for name, t in zip(following.names, parts)
            ]
            self.stats.bytes_read += sum(t.numel() * t.element_size() for t in parts)
            self.stats.prefetched += 1
            self.pending[key] = (parts, _waiting(waits))

    def forget(self) -> None:
        """Drop cached and read-ahead experts (after the weights changed: a training step, a load)."""
        for _, wait in self.pending.values():
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
