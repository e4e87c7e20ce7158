"""The option objects of ``offload_parameters`` and ``from_pretrained``: what to load, how to train, how to stream.

Each is a small frozen dataclass checked when it is made (a wrong type is a ``TypeError``, a value out of range a
``ConfigError``, a ``ValueError``; the message names the field and what to pass), so a mistake is reported where the
object is written, before any model is touched. A new capability adds a field here, not a keyword to the entry
points. ``moved_keywords`` turns an old keyword of the entry points into a ``TypeError`` naming its new place.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, cast

import torch

from ...errors import ConfigError
from ..memory import parse_bytes
from .guards.refusals import check_budget
from .offload import MODES, OptimizerFactory
from .setup.init_policy import Init, check_arguments

Function = TypeVar("Function", bound=Callable[..., Any])


@dataclass(frozen=True)
class LoadOptions:
    """What to load into a model's blocks as they are offloaded, and where its values come from.

    Attributes:
        checkpoint: Load the module's values from this checkpoint (a ``.safetensors`` file, a Hugging Face sharded
            folder with its index, or a ``torch.save`` state dict) block by block while offloading, converting
            floating point dtypes to the module's; names and shapes are checked first (``CheckpointError`` listing
            every missing, unexpected or mis-shaped name). A transformers model's checkpoint is read through
            transformers' own renaming and conversion rules, as its ``from_pretrained`` reads it (the model rules of
            ``setup/model_rules.py``; transformers' are in ``deepoffload/integrations/hugging_face/``).
            None: the module's own values (tensors on the ``meta`` device get theirs from ``init``).
            ``from_pretrained`` sets it to its folder.
        init: For a module with tensors on the ``meta`` device: which of them may get values from an initializer
            (see ``init_policy``). A function: called with each module owning tensors no checkpoint gives, children
            before parents. ``state_dict()`` names or ``fnmatch`` patterns (e.g. ``["classifier.*"]``): those
            tensors, if the checkpoint lacks them, are initialized by the model's own initializer (a Hugging Face
            model's ``_init_weights``, else each module's ``reset_parameters()``); any other missing one is a
            ``CheckpointError``. None: with a checkpoint, only what no checkpoint holds (non-persistent buffers such
            as rotary ``inv_freq``, names a transformers model declares may be missing); without one, everything.
        dtype: Floating-point parameters made from ``meta`` get this dtype (like transformers' ``from_pretrained``
            ``dtype``); buffers keep the dtype they were built with, and so do the parameters a transformers model
            keeps in float32 (``_keep_in_fp32_modules``, by transformers' own dtype plan). None: as built.
        strict: False allows names the checkpoint has beyond the model, and missing ones that keep a value (the
            module's own, or one ``init`` gives); both are reported in ``ParameterOffload.load_report``.
        serve_from_checkpoint: For inference: blocks whose parameters lie in the (safetensors) ``checkpoint`` in
            the model's dtype, back to back in one file, are read from there and never copied to the swap folder;
            the others are copied as usual. The checkpoint is never written: a backward that would train a served
            block raises, and so does releasing one whose parameters user code changed. Needs a ``checkpoint``.

    Raises:
        TypeError: When ``checkpoint`` is not a path, ``init`` neither a function nor names, or ``strict`` or
            ``serve_from_checkpoint`` not a bool.
        ValueError: When ``dtype`` is not a floating-point ``torch.dtype``.

    Examples:
        >>> import torch
        >>> from deepoffload import LoadOptions
        >>> load = LoadOptions(checkpoint="model.safetensors", dtype=torch.bfloat16)
        >>> load.strict, load.serve_from_checkpoint
        (True, False)
        >>> load.replace(serve_from_checkpoint=True).serve_from_checkpoint
        True
    """

    checkpoint: str | os.PathLike | None = None
    init: Init | None = None
    dtype: torch.dtype | None = None
    strict: bool = True
    serve_from_checkpoint: bool = False

    def __post_init__(self) -> None:
        check_arguments(self.checkpoint, self.init, self.dtype, self.strict)
        if not isinstance(self.serve_from_checkpoint, bool):
            raise TypeError(f"serve_from_checkpoint=: expected True or False, got {self.serve_from_checkpoint!r}")

    def replace(self, **changes: Any) -> "LoadOptions":
        """A copy with some fields changed (checked as in the constructor).

        Args:
            **changes: The fields to change, by name, with their new values.

        Returns:
            The new options; these are unchanged.
        """
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TrainOptions:
    """How the streamed blocks train: the optimizer, when it steps, and across how many ranks.

    Attributes:
        optimizer: A factory called with a list of parameters that returns a ``torch.optim.Optimizer`` (e.g.
            ``lambda ps: torch.optim.AdamW(ps, lr=1e-4)``); called once for the blocks' master weights and once for
            the parameters outside blocks; their state is offloaded too.
        mode: "fused" (optimizer step inside backward, memory-minimal) or "grads" (gradients to storage, ``step()``
            streams); see ``deepoffload.swap.params``.
        data_parallel: True (the default process group) or a ``torch.distributed.ProcessGroup``: every rank
            streams the model from its own swap folder and the gradients are averaged across the ranks as
            ``DistributedDataParallel`` averages them (see ``data_parallel``); do not wrap the model in DDP. A model
            on the ``meta`` device then needs ``LoadOptions(checkpoint=..., strict=True)`` (every rank must load the
            same values). False: this process alone.

    Raises:
        TypeError: When ``optimizer`` is not callable or ``data_parallel`` is neither a bool nor a
            ``ProcessGroup``.
        ValueError: When ``mode`` is not one of ``MODES``.

    Examples:
        >>> import torch
        >>> from deepoffload import TrainOptions
        >>> train = TrainOptions(lambda ps: torch.optim.AdamW(ps, lr=1e-4), mode="grads")
        >>> train.mode, train.data_parallel
        ('grads', False)
        >>> TrainOptions(torch.optim.SGD, mode="later")
        Traceback (most recent call last):
        ...
        deepoffload.errors.ConfigError: mode 'later': expected one of fused, grads
    """

    optimizer: OptimizerFactory
    mode: str = "fused"
    data_parallel: bool | torch.distributed.ProcessGroup = False

    def __post_init__(self) -> None:
        if not callable(self.optimizer):
            raise TypeError(
                "optimizer=: expected a factory taking a list of parameters (e.g. a torch.optim class or a "
                f"lambda), got {type(self.optimizer).__name__}"
            )
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r}: expected one of {', '.join(MODES)}")
        group = torch.distributed.ProcessGroup if torch.distributed.is_available() else ()
        if not isinstance(self.data_parallel, (bool, group)):
            raise TypeError(
                "data_parallel=: expected True, False or a torch.distributed.ProcessGroup, got "
                f"{type(self.data_parallel).__name__}"
            )

    def replace(self, **changes: Any) -> "TrainOptions":
        """A copy with some fields changed (checked as in the constructor).

        Args:
            **changes: The fields to change, by name, with their new values.

        Returns:
            The new options; these are unchanged.
        """
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class StreamOptions:
    """How the blocks stream: how far ahead they are read, in what dtype they compute, how many stay in memory.

    Attributes:
        prefetch: How many blocks ahead are read while one computes (0: read each block when it starts).
        compute_dtype: Blocks compute in this floating-point dtype while their stored (master) weights keep theirs
            (None: their own).
        max_resident_bytes: Blocks whose parameters (stored plus compute copy) fit in this many bytes stay in
            memory and are never re-read by the schedule, the first blocks first; the rest stream. Pinned blocks
            also step in memory, never written or read back. With the model's size, inference and training read
            and write no parameter bytes after setup. See ``ParameterOffload.set_max_resident_bytes``.
        max_memory: The process's memory limit, in bytes or as a string ("6GB", "512MiB"): the prefetch depth (at
            most ``prefetch``), the optimizer's staging buffers and the bytes of blocks kept in memory (up to
            ``max_resident_bytes``; by default as many as fit, a tenth of the limit left free) are chosen so that
            the process as measured now (``RssAnon``, after ``malloc_trim``) plus the offload's own memory
            (``plan``, see ``budget``) plus 64 MiB for the activations of your forward stays within it; when even
            prefetch 0 and the fewest buffers cannot, ``MemoryBudgetError`` (a ``MemoryError``) at once (before
            anything is read or written) names the least limit that works and what it is made of. ``off.plan``
            holds the parts chosen.
        recompute: Whether a block's backward recomputes its forward (True: only its inputs are kept between
            forward and backward). False: a block none of whose parameters is trainable (e.g. a frozen base under
            LoRA adapters) keeps its forward's graph, its activations in memory as in memory, and its backward reads
            the block again without recomputing it: one forward's compute less per step, the activations of every
            such block more memory until its backward. Blocks with trainable parameters recompute either way.

    Raises:
        TypeError: When ``max_memory`` is neither bytes nor a string.
        ValueError: When ``recompute`` is not a bool, ``prefetch`` not a number of blocks (0 or more),
            ``compute_dtype`` not a floating-point ``torch.dtype``, ``max_resident_bytes`` not a number of bytes (0
            or more) or ``max_memory`` not a positive size.

    Examples:
        >>> import torch
        >>> from deepoffload import StreamOptions
        >>> StreamOptions(prefetch=2, compute_dtype=torch.bfloat16, max_memory="6GB").max_memory
        '6GB'
        >>> StreamOptions(prefetch=-1)
        Traceback (most recent call last):
        ...
        deepoffload.errors.ConfigError: prefetch=-1: expected a number of blocks, 0 or more
    """

    prefetch: int = 1
    compute_dtype: torch.dtype | None = None
    max_resident_bytes: int | None = None
    max_memory: int | str | None = None
    recompute: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, bool):
            raise ConfigError(f"recompute={self.recompute!r}: expected True or False")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise ConfigError(f"prefetch={self.prefetch!r}: expected a number of blocks, 0 or more")
        dtype = self.compute_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"compute_dtype={dtype!r}: expected a floating-point torch.dtype, e.g. torch.bfloat16")
        check_budget(self.max_resident_bytes)
        if self.max_memory is not None:
            parse_bytes(self.max_memory)

    def replace(self, **changes: Any) -> "StreamOptions":
        """A copy with some fields changed (checked as in the constructor).

        Args:
            **changes: The fields to change, by name, with their new values.

        Returns:
            The new options; these are unchanged.
        """
        return dataclasses.replace(self, **changes)


OPTIONS = {LoadOptions: "load", TrainOptions: "train", StreamOptions: "stream"}
# each keyword the entry points took before these objects -> (the keyword that replaces it, its object)
MOVED = {f.name: (keyword, cls) for cls, keyword in OPTIONS.items() for f in dataclasses.fields(cls)}
# (entry point, keyword) -> where it went instead, where that is not its options object
MOVED_ELSEWHERE = {
    ("from_pretrained", "checkpoint"): "the folder given: from_pretrained(<the checkpoint's folder>, ...), "
    "which reads its config.json and weights (a LoadOptions with checkpoint= is refused there)"
}


def moved_keywords(function: Function) -> Function:
    """Wrap an entry point so that a keyword moved into an options object is a ``TypeError`` naming its new place.

    Args:
        function: ``offload_parameters`` or ``from_pretrained``.

    Returns:
        The function, refusing ``MOVED`` keywords (``optimizer=`` -> ``train=TrainOptions(optimizer=...)``).
    """

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        moved = [name for name in kwargs if name in MOVED]
        if moved:
            raise TypeError(
                f"{function.__name__}(): options are grouped in objects now: "
                + "; ".join(
                    f"{name}= is "
                    + MOVED_ELSEWHERE.get(
                        (function.__name__, name), f"{MOVED[name][0]}=deepoffload.{MOVED[name][1].__name__}({name}=...)"
                    )
                    for name in moved
                )
            )
        return function(*args, **kwargs)

    return cast(Function, checked)


def check_options(**given: Any) -> None:
    """Refuse an options keyword given something other than its object (``train=adam`` instead of ``TrainOptions``).

    Args:
        **given: The keywords ``load``, ``train``, ``stream`` with the values passed (None allowed).

    Raises:
        TypeError: When a value is not None and not its options object.
    """
    expected = {keyword: cls for cls, keyword in OPTIONS.items()}
    for keyword, value in given.items():
        cls = expected[keyword]
        if value is not None and not isinstance(value, cls):
            raise TypeError(
                f"{keyword}=: expected a deepoffload.{cls.__name__}(...) or None, got {type(value).__name__}"
            )
