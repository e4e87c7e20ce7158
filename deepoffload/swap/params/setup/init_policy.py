"""What ``init=`` allows: which tensors of a model built on ``meta`` may get their values from an initializer.

A tensor the checkpoint gives is read from it. One it lacks gets a value from an initializer only where the user
asked for it: ``init=`` a function (it initializes every such tensor), or ``init=`` names and ``fnmatch`` patterns
of ``state_dict()`` names (those tensors are initialized by the model's own initializer, as its model rules name it:
a transformers model's ``_init_weights``, as transformers' ``from_pretrained`` initializes missing weights; else
each module's ``reset_parameters()``). Without a checkpoint, ``init=None`` initializes everything with the model's own
initializer (the model as its constructor makes it). Tensors no checkpoint holds by design (non-persistent buffers,
such as rotary ``inv_freq`` or BERT's ``position_ids``) are always computed by that initializer, and so are the
names the model rules declare may be missing (a transformers model's ``_keys_to_ignore_on_load_missing``).
"""

from __future__ import annotations

import fnmatch
import os
from typing import Collection, Union

import torch
from torch import nn

from ....formats.header import CheckpointError
from .model_rules import InitFunction, rules_for

Init = Union[InitFunction, Collection[str], str]


class InitPolicy:
    """The initializer ``Materializer`` calls, and which missing tensors it may give values (see the module docs).

    Args:
        module: The model.
        init: ``offload_parameters``'s ``init=``: None, a function called with each module, or names/patterns.
        checkpoint: Whether values come from a checkpoint.
    """

    def __init__(self, module: nn.Module, init: Init | None, checkpoint: bool):
        self.explicit = callable(init)
        self.function: InitFunction | None = init if callable(init) else rules_for(module).init_function(module)
        if init is None or callable(init):
            self.patterns: list[str] | None = None if (self.explicit or not checkpoint) else []
        else:
            self.patterns = [init] if isinstance(init, str) else list(init)

    def allows(self, name: str) -> bool:
        """Whether the tensor ``name`` (a ``state_dict()`` name) may be initialized."""
        return self.patterns is None or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def missing_advice(self, missing: list[str], strict: bool) -> str:
        """What to pass so that the ``missing`` tensors get values (for an error message)."""
        patterns = {n.rpartition(".")[0] + ".*" if "." in n else n for n in missing}
        shown = sorted(missing) if len(missing) <= 5 else sorted(patterns)
        first = "strict=False and " if strict else ""
        return (
            f". To give them values, pass {first}init={shown!r} "
            f"(each module owning them is initialized by the model's own initializer, as transformers' "
            f"from_pretrained initializes missing weights), init= a function called with each such module, or a "
            f"checkpoint holding them"
        )

    def check_missing(self, missing: list[str], declared: set[str], source: str) -> None:
        """Raise unless every tensor of ``missing`` (on ``meta``, without a value) may be initialized.

        Args:
            missing: ``state_dict()`` names of meta tensors the checkpoint lacks (all of them without one).
            declared: Names the model declares may be missing (always allowed).
            source: The checkpoint's path, for the message.

        Raises:
            CheckpointError: Naming the tensors that would have no value and what to pass.
        """
        refused = [n for n in missing if n not in declared and not self.allows(n)]
        if refused:
            raise CheckpointError(
                f"{source} lacks {len(refused)} tensors the model needs and init= does not cover: "
                f"{sorted(refused)[:20]}{self.missing_advice(refused, strict=False)}"
            )


def check_arguments(checkpoint, init, dtype, strict) -> None:
    """Check ``offload_parameters``'s loading arguments before anything is made.

    Args:
        checkpoint: A path, or None.
        init: A callable, names/patterns, or None.
        dtype: A floating-point ``torch.dtype``, or None.
        strict: True or False.

    Raises:
        TypeError: When ``checkpoint`` is not a path, ``init`` neither callable nor names, or ``strict`` not a bool.
        ValueError: When ``dtype`` is not a floating-point dtype.
    """
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint=: expected a path (a .safetensors file, a sharded folder with its index, or a "
            f"torch.save file), got {type(checkpoint).__name__}"
        )
    names = isinstance(init, str) or (
        isinstance(init, Collection) and not isinstance(init, bytes) and all(isinstance(n, str) for n in init)
    )
    if init is not None and not callable(init) and not names:
        raise TypeError(
            f"init=: expected a function called with each module, or state_dict() names/patterns of the tensors "
            f"to initialize, got {type(init).__name__}"
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r}: expected a floating-point torch.dtype")
    if not isinstance(strict, bool):
        raise TypeError(f"strict=: expected True or False, got {strict!r}")
