"""A checkpoint seen in a transformers model's own names, converted by transformers' own loading rules.

``save_pretrained`` writes some models' tensors under other names or split differently than the model holds them
(GPT-NeoX's ``embed_out`` is ``lm_head``; Mixtral's and Qwen2-MoE's per-expert weights become the fused
``experts.gate_up_proj`` / ``down_proj``; a base model's folder loads into a model with a head under
``base_model_prefix``). ``ConvertedCheckpoint`` applies what transformers' ``from_pretrained`` applies: the weight
transforms ``transformers.conversion_mapping.get_model_conversion_mapping(model)`` collects (the model's and its
sub-models' registered renamings and converters, and the legacy ones), ``core_model_loading.rename_source_key`` with
the ``base_model_prefix`` rule, the converters' own operations (run on the source tensors of one target at a time,
so a block's converted tensors are made when that block is loaded), and the model's
``_adjust_missing_and_unexpected_keys`` (``_keys_to_ignore_on_load_*``). No table of names is kept here.

transformers is imported only when such a checkpoint is opened.
"""

from __future__ import annotations

import copy
import types
from typing import Any, Mapping

import torch
from torch import nn

from ...formats.checks import KeyReport, compare_keys, convertible
from ...formats.header import CheckpointError
from ...formats.reader import NAMES_HINT, CheckpointReader


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(module).__mro__
    )


def kept_in_float32(module: nn.Module, dtype: torch.dtype) -> set[int]:
    """Ids of the parameters a transformers model keeps in float32 when loaded in ``dtype``.

    transformers' own rule: the model's ``_get_dtype_plan(dtype)`` (``_keep_in_fp32_modules`` for float16,
    ``_keep_in_fp32_modules_strict`` for float16 and bfloat16), matched as ``convert_and_load_state_dict_in_model``
    matches it (``build_glob_alternation``).

    Args:
        module: The model (any module: none for one that is not a transformers model).
        dtype: The dtype asked for.

    Returns:
        The ids of the parameters to keep as built.
    """
    plan = getattr(module, "_get_dtype_plan", None)
    if not is_transformers_model(module) or not callable(plan):
        return set()
    kept = {pattern for pattern, to in plan(dtype).items() if to == torch.float32}
    if not kept:
        return set()
    from transformers.core_model_loading import build_glob_alternation

    alternation, _, _ = build_glob_alternation(sorted(kept))
    return {id(p) for name, p in module.named_parameters() if alternation.search(name)}


def tie_hf_weights(module: nn.Module) -> None:
    """Tie a Hugging Face model's weights as ``from_pretrained`` does.

    Under accelerate's ``init_empty_weights()`` every parameter assignment makes a new meta parameter, so the model's
    own tying (``lm_head.weight = embed_tokens.weight``) leaves two parameters; the checkpoint then lacks one
    (``save_pretrained`` drops tied copies) and a model loaded anyway would compute with an untied, freshly initialized
    head.
    """
    tie = getattr(module, "tie_weights", None)
    meta = any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())
    if meta and callable(tie) and hasattr(module, "config"):
        tie()


def missing_allowed(module: nn.Module, missing: list[str]) -> set[str]:
    """The names of ``missing`` a transformers model declares may be missing (``_keys_to_ignore_on_load_missing``).

    Args:
        module: The model.
        missing: ``state_dict()`` names the checkpoint lacks.

    Returns:
        Those the model's ``_adjust_missing_and_unexpected_keys`` removes from the missing ones.
    """
    report = types.SimpleNamespace(missing_keys=set(missing), unexpected_keys=set())
    adjust = getattr(module, "_adjust_missing_and_unexpected_keys", None)
    if callable(adjust):
        adjust(report)
    return set(missing) - report.missing_keys


class _Group:
    """The checkpoint tensors one transformers ``WeightConverter`` turns into one or more model tensors."""

    def __init__(self, converter: Any, first: str):
        self.converter = converter  # the registered converter (copied for each conversion)
        self.first = first  # the first target's name (transformers' layer name for the conversion)
        self.sources: list[tuple[str, str]] = []  # (checkpoint name, matched source pattern), transformers' order
        self.targets: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # made name -> (shape, dtype)


class ConvertedCheckpoint:
    """A ``CheckpointReader`` seen through a transformers model's loading rules (see the module docstring).

    It answers what ``Materializer`` asks a reader (names, shapes, ``check``, ``read_into``, ``location``) in the
    model's ``state_dict()`` names.

    Args:
        reader: The open checkpoint.
        model: The transformers model it loads into (on ``meta`` or not; only names and shapes are read).

    Raises:
        CheckpointError: When two checkpoint tensors become the same model tensor, or a converter cannot say which
            tensors it makes (its operations fail on shapes alone).
    """

    def __init__(self, reader: CheckpointReader, model: nn.Module):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self.reader = reader
        self.path = reader.path
        self.format = reader.format
        self.model = model
        transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        meta = model.state_dict(keep_vars=True)
        prefix = getattr(model, "base_model_prefix", None) or None
        self.sources: dict[str, str] = {}  # model name -> checkpoint name (renamed or as it is)
        self.groups: dict[str, _Group] = {}  # first target -> group
        unexpected: list[str] = []
        for key in sorted(reader.names(), key=dot_natural_key):  # (the order transformers collects sources in)
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if renamed not in meta and key in meta:  # as transformers: a model name is not renamed away
                renamed, pattern = rename_source_key(key, [], [], prefix, meta)
            if renamed not in meta:
                targets = by_pattern[pattern].target_patterns if pattern is not None else [renamed]
                unexpected += [renamed.replace(targets[0], t) for t in targets]
            elif pattern is not None:
                self.groups.setdefault(renamed, _Group(by_pattern[pattern], renamed)).sources.append((key, pattern))
            elif renamed in self.sources:
                raise CheckpointError(
                    f"{self.path}: {self.sources[renamed]!r} and {key!r} both become {renamed!r} by transformers' "
                    f"loading rules; remove one of them from the checkpoint"
                )
            else:
                self.sources[renamed] = key
        self.group_of: dict[str, str] = {}
        for group in self.groups.values():
            group.targets = self._shapes(group, meta)
            self.group_of.update(dict.fromkeys(group.targets, group.first))
        report = types.SimpleNamespace(missing_keys=set(), unexpected_keys=set(unexpected))
        adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
        if callable(adjust):
            adjust(report)
        self.unexpected = [k for k in unexpected if k in report.unexpected_keys]

    # -- what is in it ----------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Return the model names the checkpoint gives a value (renamed, as they are, or made by a converter)."""
        return [*self.sources, *self.group_of]

    def __contains__(self, name: str) -> bool:
        return name in self.sources or name in self.group_of

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Return the shape and dtype the checkpoint gives model tensor ``name``.

        Args:
            name: A model tensor's name.

        Returns:
            ``(shape, dtype)``: as stored, or as the converter makes it.

        Raises:
            KeyError: When the checkpoint gives ``name`` no value.
        """
        if name in self.sources:
            return self.reader.shape_dtype(self.sources[name])
        if name in self.group_of:
            return self.groups[self.group_of[name]].targets[name]
        raise KeyError(f"{self.path}: no tensor for {name!r}")

    def location(self, name: str) -> Any:
        """Where model tensor ``name``'s bytes lie (see ``CheckpointReader.location``); None for a converted one."""
        return self.reader.location(self.sources[name]) if name in self.sources else None

    def missing_allowed(self, missing: list[str]) -> set[str]:
        """The names of ``missing`` the model declares may be missing (``_keys_to_ignore_on_load_missing``)."""
        return missing_allowed(self.model, missing)

    def check(self, expected: Mapping[str, Any], strict: bool = True) -> KeyReport:
        """Compare what the checkpoint gives with ``expected`` (as ``CheckpointReader.check`` does, in model names).

        Args:
            expected: Model name -> tensor, shape or (shape, dtype).
            strict: Whether missing and unexpected names are errors.

        Returns:
            The missing model names and the unexpected (renamed) checkpoint names.

        Raises:
            CheckpointError: Listing every problem, when any.
        """
        return compare_keys(
            self.names(),
            self.shape_dtype,
            expected,
            strict,
            lambda problems, names: (
                f"{self.path} does not match the model's tensors (after transformers' loading "
                f"rules): {problems}" + (NAMES_HINT if names else "")
            ),
            unexpected_before=self.unexpected,
        )

    # -- reading ----------------------------------------------------------------------------------------------
    def _convert(self, group: _Group, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(group.converter)
        for key, pattern in group.sources:
            converter.add_tensor(group.first, key, pattern, lambda t=tensors[key]: t)
        made = converter.convert(group.first, model=self.model, config=getattr(self.model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}

    def _shapes(self, group: _Group, meta: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], Any]]:
        stored = {key: self.reader.shape_dtype(key) for key, _ in group.sources}
        try:
            made = self._convert(group, {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in stored.items()})
        except Exception as e:
            raise CheckpointError(
                f"{self.path}: transformers' converter for {group.first!r} "
                f"({type(group.converter).__name__} of {[k for k, _ in group.sources][:4]}) cannot run on shapes "
                f"alone ({type(e).__name__}: {e}); load the model with transformers' from_pretrained and pass it "
                f"to offload_parameters() without checkpoint=, or save it with off.save() first"
            ) from e
        return {name: (tuple(t.shape), t.dtype) for name, t in made.items() if name in meta}

    def read_into(self, destinations: Mapping[str, torch.Tensor]) -> None:
        """Fill each named model tensor with the value the checkpoint gives it (converting floating point dtypes).

        Renamed tensors are read by ``CheckpointReader.read_into``; a converted one by reading its sources, cast to
        the destination's dtype as transformers casts them, and running the converter's operations.

        Args:
            destinations: Model name -> materialized tensor to fill.

        Raises:
            CheckpointError: When a name has no value in the checkpoint, or a converted tensor's shape or dtype
                differs from its destination's.
        """
        unknown = [n for n in destinations if n not in self]
        if unknown:
            raise CheckpointError(f"{self.path}: cannot read into the given tensors: {unknown[:20]} not in it")
        direct = {self.sources[n]: t for n, t in destinations.items() if n in self.sources}
        if direct:
            self.reader.read_into(direct)
        for first in dict.fromkeys(self.group_of[n] for n in destinations if n in self.group_of):
            group = self.groups[first]
            wanted = destinations.get(first)
            dtype = wanted.dtype if wanted is not None and wanted.is_floating_point() else None
            tensors = self.reader.read([key for key, _ in group.sources])
            if dtype is not None:
                tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
            for name, value in self._convert(group, tensors).items():
                destination = destinations.get(name)
                if destination is None:
                    continue
                if tuple(value.shape) != tuple(destination.shape) or not convertible(value.dtype, destination.dtype):
                    raise CheckpointError(
                        f"{self.path}: {name} converted is {value.dtype} {list(value.shape)}, the model's is "
                        f"{destination.dtype} {list(destination.shape)}"
                    )
                with torch.no_grad():
                    destination.copy_(value)

    def close(self) -> None:
        """Close the checkpoint."""
        self.reader.close()
