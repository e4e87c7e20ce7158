"""The Hugging Face ``transformers`` rules (``ModelRules``), registered when this module is imported.

The core imports it by name (``KNOWN`` in ``deepoffload/swap/params/setup/model_rules.py``) the first time it is asked
about a model or value whose class is defined under ``transformers``. What each rule does is in ``keys`` (checkpoint
names, float32 plan, tying) and ``caches`` (what a block's recomputation rewinds).
"""

from __future__ import annotations

import torch
from torch import nn

from ...swap.params.blocks.experts import ExpertSet
from ...swap.params.setup.model_rules import CheckpointView, InitFunction, ModelRules, register_rules
from . import caches, keys, moe


class HuggingFaceRules(ModelRules):
    """A transformers ``PreTrainedModel``: loaded, tied, initialized and given caches as transformers does."""

    name = "transformers"

    def claims(self, module: nn.Module) -> bool:  # noqa: D102 (see ModelRules)
        return keys.is_transformers_model(module)

    def checkpoint(self, reader: CheckpointView, module: nn.Module) -> CheckpointView:  # noqa: D102
        return keys.ConvertedCheckpoint(reader, module)  # type: ignore[arg-type]

    def missing_allowed(self, module: nn.Module, missing: list[str]) -> set[str]:  # noqa: D102
        return keys.missing_allowed(module, missing)

    def kept_in_float32(self, module: nn.Module, dtype: torch.dtype) -> set[int]:  # noqa: D102
        return keys.kept_in_float32(module, dtype)

    def tie_weights(self, module: nn.Module) -> None:  # noqa: D102
        if any(keys.is_transformers_model(m) for m in module.modules()):  # (a wrapper's, peft's say, tied through it)
            keys.tie_hf_weights(module)

    def init_function(self, module: nn.Module) -> InitFunction | None:  # noqa: D102
        init = getattr(module, "_init_weights", None)
        return init if callable(init) else None

    def is_cache(self, value: object) -> bool:  # noqa: D102
        return caches.is_cache(value)

    def check_cache(self, block_name: str, cache: object) -> None:  # noqa: D102
        caches.check_cache(block_name, cache)

    def cache_objects(self, cache: object) -> list[object]:  # noqa: D102
        return caches.cache_objects(cache)

    def experts(self, module: nn.Module) -> list[ExpertSet]:  # noqa: D102
        return moe.experts_of(module)


register_rules(HuggingFaceRules())
