"""transformers' Mixture-of-Experts modules, found by what transformers' own experts modules are.

transformers (5.x) fuses each MoE layer's experts into one module holding 3-D parameters whose first dimension is the
expert (``gate_up_proj``, ``down_proj``; Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE and the families its conversion
mappings route to them), with ``num_experts`` set and a forward called as ``experts(hidden_states, top_k_index,
top_k_weights)``, every experts implementation (``eager``, ``batched_mm``, ``grouped_mm``) indexing the parameters by
``top_k_index`` and skipping index ``num_experts``. Its router is the sibling module whose ``weight`` has one row per
expert. No family is named here.
"""

from __future__ import annotations

import inspect

from torch import nn

from ...swap.params.blocks.experts import ExpertSet


def _is_experts(module: nn.Module) -> bool:
    count = getattr(module, "num_experts", None)
    params = list(module.named_parameters(recurse=False))
    if (
        not isinstance(count, int)
        or count < 2
        or not params
        or any(True for c in module.children() for _ in c.parameters())
    ):
        return False
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False  # (no signature: not a module this knows how to call)
    return names[1:3] == ["top_k_index", "top_k_weights"] and all(
        p.dim() == 3 and p.shape[0] == count for _, p in params
    )


def experts_of(model: nn.Module) -> list[ExpertSet]:
    """The experts modules of a transformers model, in module order, each with its router when found.

    Args:
        model: The model.

    Returns:
        One ``ExpertSet`` per experts module.
    """
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if not _is_experts(child):
                continue
            count = child.num_experts
            routers = [
                m
                for n, m in parent.named_children()
                if n != name and getattr(getattr(m, "weight", None), "shape", (None,))[0] == count
            ]
            found.append(
                ExpertSet(
                    child,
                    tuple(n for n, _ in child.named_parameters(recurse=False)),
                    "num_experts",
                    routers[0] if len(routers) == 1 else None,
                )
            )
    return found
