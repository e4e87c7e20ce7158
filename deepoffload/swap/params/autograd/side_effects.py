"""Side effects of a block's forward that backward's recomputation must not repeat, and must see as the forward did.

These are buffer updates (BatchNorm running statistics, counters) and key/value caches passed in (Hugging Face
``DynamicCache``). RNG draws are replayed by ``recompute`` itself (it runs under the forward's RNG state).

``capture`` takes a block's state before its forward; ``Captured.replay()`` runs the recomputation on that state
and puts back what the forward left, so the outcome is as if the block ran once.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def _is_cache(value: object) -> bool:
    """A Hugging Face ``transformers`` cache (by its base class name: no import of transformers here)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def _rebinding_layer(layer: object) -> bool:
    """Cache layers that store new tensors by rebinding attributes (``torch.cat``), never writing in place."""
    return any(c.__name__ == "DynamicLayer" for c in type(layer).__mro__)


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


def _nested(cache: object) -> list[object]:
    """The caches a cache holds (an ``EncoderDecoderCache``: its self- and cross-attention caches)."""
    return [v for v in vars(cache).values() if _is_cache(v)]


def _cache_objects(cache: object) -> list[object]:
    return [cache, *getattr(cache, "layers", ()), *(o for inner in _nested(cache) for o in _cache_objects(inner))]


def check_caches(block_name: str, flat: list) -> list[object]:
    """The caches among a training call's arguments, refusing those recomputation cannot rewind exactly.

    A cache is rewound when it has layers that store by rebinding, or (``EncoderDecoderCache``) holds only such
    caches.

    Args:
        block_name: The block's name, for the message.
        flat: The call's arguments, flattened.

    Returns:
        The caches found, in argument order.

    Raises:
        ValueError: When a cache among them cannot be rewound (a ``StaticCache``, say).
    """
    caches = [x for x in flat if _is_cache(x)]
    for cache in caches:
        inner = _nested(cache)
        parts = inner or [cache]
        bad = [layer for part in parts for layer in getattr(part, "layers", ()) if not _rebinding_layer(layer)]
        if bad or any(not hasattr(part, "layers") or _nested(part) for part in parts):
            what = type(bad[0]).__name__ if bad else type(cache).__name__
            raise ValueError(
                f"block {block_name}: a {what} is passed to it in a forward with gradients enabled; its "
                f"backward recomputes the block, which would update that cache a second time. Use a "
                f"DynamicCache, or use_cache=False when training"
            )
    return caches


class Captured:
    """A block's buffers (copied) and its caches' state (references) before one forward."""

    def __init__(self, module: nn.Module, caches: list[object]):
        self.module = module
        self.buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
        self.caches = [_ObjectsState(_cache_objects(c)) for c in caches]
        self.cache_list = caches

    def detach_new_cache_entries(self) -> None:
        """Detach the tensors the forward stored in the caches from the recomputed block's graph.

        That graph would otherwise keep every block's activations alive as long as the cache.
        """
        before = {id(o): d for state in self.caches for o, d in state.dicts}
        for cache in self.cache_list:
            for o in _cache_objects(cache):
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
        after_caches = [_ObjectsState(_cache_objects(c)) for c in self.cache_list]
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
