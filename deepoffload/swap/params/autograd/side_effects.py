"""Side effects of a block's forward that backward's recomputation must not repeat, and must see as the forward did.

These are buffer updates (BatchNorm running statistics, counters) and key/value caches passed in (Hugging Face
``DynamicCache``: which arguments are caches, and which objects hold their state, the registered model rules say,
``setup/model_rules.py``). RNG draws are replayed by ``recompute`` itself (it runs under the forward's RNG state).

``capture`` takes a block's state before its forward; ``Captured.replay()`` runs the recomputation on that state
and puts back what the forward left, so the outcome is as if the block ran once.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..setup.model_rules import ModelRules, caches_in


class _ObjectsState:
    """The attribute dicts of some objects and the contents of their lists and dicts, as references (not copies).

    The lists and dicts are such as an ``EncoderDecoderCache``'s ``is_updated``.
    """

    def __init__(self, objects: list[object]):
        self.dicts = [(o, dict(vars(o))) for o in objects]
        self.lists = [(v, list(v)) for _, d in self.dicts for v in d.values() if isinstance(v, list)]
        self.maps = [(v, dict(v)) for _, d in self.dicts for v in d.values() if isinstance(v, dict)]

    def restore(self) -> None:
        for target, items in self.lists:
            target[:] = items
        for mapping, saved in self.maps:
            mapping.clear()
            mapping.update(saved)
        for o, saved in self.dicts:
            vars(o).clear()
            vars(o).update(saved)


def check_caches(block_name: str, flat: list) -> list[tuple[object, ModelRules]]:
    """The caches among a training call's arguments (as the model rules know them), refusing any not rewindable.

    Args:
        block_name: The block's name, for the message.
        flat: The call's arguments, flattened.

    Returns:
        The caches found with their rules, in argument order.

    Raises:
        ValueError: When a cache among them cannot be rewound (a Hugging Face ``StaticCache``, say).
    """
    found = caches_in(flat)
    for cache, rules in found:
        rules.check_cache(block_name, cache)
    return found


class Captured:
    """A block's buffers (copied) and its caches' state (references) before one forward."""

    def __init__(self, module: nn.Module, caches: list[tuple[object, ModelRules]]):
        self.module = module
        self.buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
        self.cache_list = caches
        self.caches = [_ObjectsState(rules.cache_objects(cache)) for cache, rules in caches]

    def detach_new_cache_entries(self) -> None:
        """Detach the tensors the forward stored in the caches from the recomputed block's graph.

        That graph would otherwise keep every block's activations alive as long as the cache.
        """
        before = {id(o): d for state in self.caches for o, d in state.dicts}
        for cache, rules in self.cache_list:
            for o in rules.cache_objects(cache):  # (asked again: the forward may have added layers)
                saved = before.get(id(o), {})
                for key, value in vars(o).items():
                    if isinstance(value, torch.Tensor) and value.requires_grad and saved.get(key) is not value:
                        setattr(o, key, value.detach())

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body on the state before the forward; afterwards the state is what the forward left.

        Yields:
            Nothing: the body runs on the state before the forward.
        """
        after_buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        after_caches = [_ObjectsState(rules.cache_objects(cache)) for cache, rules in self.cache_list]
        self._set_buffers(self.buffers)
        for state in self.caches:
            state.restore()
        try:
            yield
        finally:
            self._set_buffers(after_buffers)
            for state in after_caches:
                state.restore()

    def _set_buffers(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                if name in values:
                    buffer.copy_(values[name])
