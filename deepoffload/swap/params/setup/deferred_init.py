"""Non-persistent buffers that a model's initializer sets from an ancestor module, not from the module holding them.

transformers' ``initialize_weights()`` calls ``_init_weights`` on every module, and some models compute a block's
non-persistent buffer from the top model (Falcon-H1's ``FalconH1Model`` copies ``mup_vector`` into each layer's
mixer). ``Materializer`` initializes the modules owning unset tensors as it walks, children first, so such a buffer is
still unset when its block is done; it is left for ``init_ancestors``, which calls the initializer on the buffer's
ancestors after the walk, deepest first, as transformers does. Everything else keeps its value: every other tensor
is flagged ``_is_hf_initialized`` (transformers' own initializers skip such tensors) and the in-memory tensors under
each ancestor are copied before the call and put back after it (an initializer may write them directly). Parameters
of blocks on storage cannot be written (a write raises).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn


def init_ancestors(
    module: nn.Module,
    unset: Mapping[str, torch.Tensor],
    init: Callable[[nn.Module], None],
    is_unset: Callable,
    streamed: set[int],
) -> list[str]:
    """Call ``init`` on the ancestors of the ``unset`` buffers, deepest first, until each has a value.

    Args:
        module: The model.
        unset: Qualified name -> buffer still holding the unset mark.
        init: The initializer (called with one module).
        is_unset: Tensor -> boolean tensor marking elements still unset.
        streamed: Ids of the blocks' parameters (on storage: neither flagged nor copied; a write to one raises).

    Returns:
        The names still unset afterwards.
    """
    modules = dict(module.named_modules())
    ancestors: set[str] = set()
    for name in unset:
        parts = name.split(".")[:-2]  # (the buffer's own module was initialized already)
        ancestors.update(".".join(parts[:k]) for k in range(len(parts) + 1))
    waiting = {id(t) for t in unset.values()} | streamed
    others = [t for t in [*module.parameters(), *module.buffers()] if id(t) not in waiting]
    flagged = [t for t in others if not getattr(t, "_is_hf_initialized", False)]
    for t in flagged:
        t._is_hf_initialized = True  # type: ignore[attr-defined]
    try:
        for prefix in sorted(ancestors, key=lambda p: -(p.count(".") + 1 if p else 0)):
            if not any(is_unset(t).any() for t in unset.values()):
                break
            ancestor = modules[prefix]
            kept = [
                (t, t.detach().clone()) for t in [*ancestor.parameters(), *ancestor.buffers()] if id(t) not in waiting
            ]
            with torch.no_grad():
                init(ancestor)
                for t, value in kept:
                    t.copy_(value)
    finally:
        for t in flagged:
            del t._is_hf_initialized  # type: ignore[attr-defined]
    return [name for name, t in unset.items() if is_unset(t).any()]
