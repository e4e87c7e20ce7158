"""Hugging Face ``transformers`` caches passed to a block: which ones its recomputation can rewind, and their state.

A ``DynamicCache`` (and an ``EncoderDecoderCache`` of them) stores new keys and values by rebinding its layers'
attributes (``torch.cat``), never writing in place, so its state before a forward is its objects' attributes, held
as references; ``side_effects`` (``deepoffload/swap/params/autograd/side_effects.py``) puts them back for the
recomputation. A cache updated in place (``StaticCache``) cannot be rewound so and is refused. Classes are known by
their names: transformers is not imported here.
"""

from __future__ import annotations


def is_cache(value: object) -> bool:
    """Whether ``value`` is a transformers cache (by its base class name).

    Args:
        value: Any object.

    Returns:
        True for an instance of a subclass of transformers' ``Cache``.
    """
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def _rebinding_layer(layer: object) -> bool:
    """Cache layers that store new tensors by rebinding attributes (``torch.cat``), never writing in place."""
    return any(c.__name__ == "DynamicLayer" for c in type(layer).__mro__)


def _nested(cache: object) -> list[object]:
    """The caches a cache holds (an ``EncoderDecoderCache``: its self- and cross-attention caches)."""
    return [v for v in vars(cache).values() if is_cache(v)]


def cache_objects(cache: object) -> list[object]:
    """The cache, its layers and those of the caches it holds: the objects whose attributes are its state.

    Args:
        cache: A transformers cache.

    Returns:
        The objects.
    """
    return [cache, *getattr(cache, "layers", ()), *(o for inner in _nested(cache) for o in cache_objects(inner))]


def check_cache(block_name: str, cache: object) -> None:
    """Refuse a cache the recomputation cannot rewind exactly.

    A cache is rewound when it has layers that store by rebinding, or (``EncoderDecoderCache``) holds only such
    caches.

    Args:
        block_name: The block's name, for the message.
        cache: A transformers cache passed to the block in a forward with gradients enabled.

    Raises:
        ValueError: When it cannot be rewound (a ``StaticCache``, say).
    """
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
