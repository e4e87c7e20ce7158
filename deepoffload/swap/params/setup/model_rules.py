"""What a family of models needs when it is loaded and trained streamed: one registry of ``ModelRules``.

Some models carry conventions of the project that defines them: a checkpoint saved under other names than the model
holds (Hugging Face's conversion mappings), parameters kept in float32 whatever the dtype asked for, weights tied by
a method, an initializer of their own, caches passed to a block's forward that its recomputation must rewind. The
core asks these questions of the rules registered here and knows none of the answers; ``ModelRules`` itself is the
default: no renaming, nothing kept, no tying, no initializer of the model's own, no caches.

Rules of a project the core knows by name only (``KNOWN``: the Hugging Face rules for classes defined under
``transformers``) are imported the first time a module or value of such a class is asked about: a plugin lookup by
name, as entry points are (a package name maps to the module that registers its rules when imported), so
``offload_parameters(model, ..., load=LoadOptions(checkpoint=...))`` on a transformers model applies transformers'
rules in a fresh process without the user importing anything else, and the core imports no code of
``deepoffload.integrations``. Other rules are registered with ``register_rules``; rules registered later are asked
first.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from ....formats.checks import KeyReport
from ..blocks.experts import ExpertSet

InitFunction = Callable[[nn.Module], None]

# top-level package of a class -> the module whose import registers the rules for that package's models and values
KNOWN: dict[str, str] = {"transformers": "deepoffload.integrations.hugging_face.rules"}


class CheckpointView(Protocol):
    """What ``Materializer`` asks of a checkpoint: ``CheckpointReader``, or a view of it in the model's own names."""

    path: Any

    def __contains__(self, name: str) -> bool: ...  # noqa: D105

    def check(self, expected: Mapping[str, Any], strict: bool = True) -> KeyReport: ...  # noqa: D102

    def location(self, name: str) -> Any: ...  # noqa: D102

    def read_into(self, destinations: Mapping[str, torch.Tensor]) -> None: ...  # noqa: D102

    def close(self) -> None: ...  # noqa: D102


class ModelRules:
    """The rules of one family of models; this base class is the default (every answer: nothing special).

    Subclass it, override what your models need, and pass an instance to ``register_rules``.
    """

    name = "default"

    def claims(self, module: nn.Module) -> bool:
        """Whether ``module`` (the model given to ``offload_parameters``) is one of this family's models."""
        return False

    def checkpoint(self, reader: CheckpointView, module: nn.Module) -> CheckpointView:
        """``reader`` seen in ``module``'s ``state_dict()`` names (the default: as it is)."""
        return reader

    def missing_allowed(self, module: nn.Module, missing: list[str]) -> set[str]:
        """The names of ``missing`` (not in the checkpoint) that ``module`` declares may be missing."""
        return set()

    def kept_in_float32(self, module: nn.Module, dtype: torch.dtype) -> set[int]:
        """Ids of ``module``'s parameters kept in float32 when the model is loaded in ``dtype``."""
        return set()

    def tie_weights(self, module: nn.Module) -> None:
        """Tie ``module``'s weights before they are loaded, where this family ties them (asked of every rules)."""

    def init_function(self, module: nn.Module) -> InitFunction | None:
        """The model's own initializer, called with each module whose tensors need values (None: none)."""
        return None

    def is_cache(self, value: object) -> bool:
        """Whether ``value``, an argument of a block's call, is a cache that this family's blocks update."""
        return False

    def check_cache(self, block_name: str, cache: object) -> None:
        """Raise ValueError unless ``cache`` can be rewound for the block's recomputation (by ``cache_objects``)."""

    def cache_objects(self, cache: object) -> list[object]:
        """The objects whose attributes (and lists and dicts held there) are the state of ``cache``."""
        return [cache]

    def experts(self, module: nn.Module) -> list[ExpertSet]:
        """The Mixture-of-Experts modules of ``module`` whose experts are read one by one (``ExpertSet``; none)."""
        return []


DEFAULT = ModelRules()
_RULES: list[ModelRules] = []
_LOADED: set[str] = set()
_LOCK = threading.Lock()


def register_rules(rules: ModelRules) -> None:
    """Register ``rules``, asked before every rules registered earlier (and before the default).

    Args:
        rules: The rules.

    Raises:
        ValueError: When rules of that name are registered already.
    """
    if any(r.name == rules.name for r in _RULES):
        raise ValueError(f"model rules named {rules.name!r} are registered already")
    _RULES.insert(0, rules)


def unregister_rules(name: str) -> None:
    """Remove the rules registered under ``name``.

    Args:
        name: The rules' name.

    Raises:
        KeyError: When no rules of that name are registered.
    """
    for i, rules in enumerate(_RULES):
        if rules.name == name:
            del _RULES[i]
            return
    raise KeyError(f"no model rules named {name!r} are registered (registered: {[r.name for r in _RULES]})")


def _load_known(classes: list[type]) -> None:
    """Import the ``KNOWN`` rules modules of the packages defining ``classes`` (each once per process)."""
    wanted = {KNOWN[c.__module__.partition(".")[0]] for c in classes if c.__module__.partition(".")[0] in KNOWN}
    if not wanted - _LOADED:
        return
    with _LOCK:
        for name in sorted(wanted - _LOADED):
            importlib.import_module(name)  # registers its rules; a failure propagates (nothing is loaded silently)
            _LOADED.add(name)


def rules_for(module: nn.Module) -> ModelRules:
    """The rules of ``module``'s family: the newest registered rules claiming it, else ``DEFAULT``.

    Args:
        module: The model.

    Returns:
        Its rules.
    """
    _load_known([c for m in module.modules() for c in type(m).__mro__])
    return next((r for r in _RULES if r.claims(module)), DEFAULT)


def tie_weights(module: nn.Module) -> None:
    """Let every registered rules tie ``module``'s weights where their family ties them (a wrapper's model too).

    Args:
        module: The model.
    """
    _load_known([c for m in module.modules() for c in type(m).__mro__])
    for rules in _RULES:
        rules.tie_weights(module)


def caches_in(values: list) -> list[tuple[object, ModelRules]]:
    """The caches among a block call's arguments, with the rules that know them.

    Args:
        values: The call's arguments, flattened.

    Returns:
        ``(cache, rules)`` in argument order.
    """
    others = [x for x in values if not isinstance(x, (torch.Tensor, int, float, bool, str)) and x is not None]
    if not others:
        return []
    _load_known([c for x in others for c in type(x).__mro__])
    found = []
    for x in others:
        rules = next((r for r in _RULES if r.is_cache(x)), None)
        if rules is not None:
            found.append((x, rules))
    return found
