"""``offload_parameters``, the entry point of parameter offload.

It checks its arguments, chooses the blocks and builds a ``ParameterOffload``.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch
from torch import nn

from ...errors import UnsupportedError
from ..config import SwapConfig
from .blocks.finding import find_blocks
from .budget import READER_BYTES, STATE_CHUNKS, Fitted, MemoryPlan, fit, parse_bytes, process_bytes
from .guards.refusals import check_budget
from .guards.wrappers import refuse_wrapped
from .offload import MODES, OptimizerFactory, ParameterOffload
from .setup.init_policy import Init, check_arguments
from .setup.materialize import Materializer, has_meta
from .training.data_parallel import process_group


def offload_parameters(
    module: nn.Module,
    path: str | None = None,
    *,
    blocks: Sequence[nn.Module] | None = None,
    prefetch: int = 1,
    mode: str = "fused",
    optimizer: OptimizerFactory | None = None,
    compute_dtype: torch.dtype | None = None,
    config: SwapConfig | None = None,
    checkpoint: str | os.PathLike | None = None,
    init: Init | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    max_resident_bytes: int | None = None,
    serve_from_checkpoint: bool = False,
    data_parallel: bool | torch.distributed.ProcessGroup = False,
    max_memory: int | str | None = None,
) -> ParameterOffload:
    """Move the parameters of ``module``'s blocks to storage and stream them in as the blocks run.

    Args:
        module: The model whose blocks are offloaded.
        path: The folder for swap files (default: ``config.folder``, else the temp folder); each run gets its own
            sub-folder, removed on ``close()``.
        blocks: The submodules to stream (default: see ``find_blocks``), in the order they run; a module at two
            places in the model (or listed twice) is one block, run at each place.
        prefetch: How many blocks ahead are read while one computes (0: read each block when it starts).
        mode: "fused" (optimizer step inside backward, memory-minimal) or "grads" (gradients to storage, ``step()``
            streams); see the package docstring.
        optimizer: To train, a factory called with a list of parameters that returns a ``torch.optim.Optimizer``
            (e.g. ``lambda ps: torch.optim.AdamW(ps, lr=1e-4)``); called once for the blocks' master weights and
            once for the parameters outside blocks; their state is offloaded too. None: inference only.
        compute_dtype: Blocks compute in this dtype while their stored (master) weights keep theirs.
        config: A ``SwapConfig`` (async-IO settings, pinning, checksums); buffer sizes are chosen here.
        checkpoint: Load the module's values from this checkpoint (a ``.safetensors`` file, a Hugging Face sharded
            folder with its index, or a ``torch.save`` state dict) block by block while offloading, converting
            floating point dtypes to the module's; names and shapes are checked first (``CheckpointError`` listing
            every missing, unexpected or mis-shaped name; ``strict=False`` allows unexpected ones and missing
            ones that keep a value: the module's own, or one ``init=`` gives; both reported in ``load_report``).
            A transformers model's checkpoint is read through transformers' own renaming and conversion rules, as
            its ``from_pretrained`` reads it (see ``hf_keys``). Needed for no model: a module built on the
            ``meta`` device works without it too.
        init: For a module with tensors on the ``meta`` device: which of them may get values from an initializer
            (see ``init_policy``). A function: called with each module owning tensors no checkpoint gives, children
            before parents. ``state_dict()`` names or ``fnmatch`` patterns (e.g. ``["classifier.*"]``): those
            tensors, if the checkpoint lacks them, are initialized by the model's own initializer (a Hugging Face
            model's ``_init_weights``, else each module's ``reset_parameters()``); any other missing one is a
            ``CheckpointError``. None: with a checkpoint, only what no checkpoint holds (non-persistent buffers such
            as rotary ``inv_freq``, names a transformers model declares may be missing); without one, everything.
            A value left unset is an error.
        dtype: Floating-point parameters made from ``meta`` get this dtype (like ``from_pretrained``'s
            ``torch_dtype``); buffers keep the dtype they were built with (as under accelerate's
            ``init_empty_weights()``), and so do the parameters a transformers model keeps in float32 in that dtype
            (``_keep_in_fp32_modules``, by transformers' own dtype plan).
        strict: See ``checkpoint``.
        max_resident_bytes: Blocks whose parameters (stored plus compute copy) fit in this many bytes stay in
            memory and are never re-read by the schedule, the first blocks first; the rest stream. Pinned blocks
            also step in memory, never written or read back. With the model's size, inference and training read
            and write no parameter bytes after setup. See ``ParameterOffload.set_max_resident_bytes``.
        serve_from_checkpoint: For inference: blocks whose parameters lie in the (safetensors) ``checkpoint`` in
            the model's dtype, back to back in one file, are read from there and never copied to ``path``; the
            others are copied as usual. The checkpoint is never written: a backward that would train a served block
            raises, and so does releasing one whose parameters user code changed (the change is dropped).
        data_parallel: True (the default process group) or a ``ProcessGroup``: every rank streams the model from
            its own ``path`` and the gradients are averaged across the ranks as ``DistributedDataParallel`` averages
            them (see ``data_parallel``); do not wrap the model in DDP. A model on the ``meta`` device then needs
            ``checkpoint=`` with ``strict=True`` (every rank must load the same values).
        max_memory: The process's memory limit, in bytes or as a string ("6GB", "512MiB"): the prefetch depth (at
            most ``prefetch``), the optimizer's staging buffers and the bytes of blocks kept in memory (up to
            ``max_resident_bytes``; by default as many as fit, a tenth of the limit left free) are chosen so that
            the process as measured now (``RssAnon``, after ``malloc_trim``) plus the offload's own memory
            (``plan``, see ``budget``) plus 64 MiB for the activations of your forward stays within it; when even
            prefetch 0 and the fewest buffers cannot, ``MemoryBudgetError`` (a ``MemoryError``) at once (before
            anything is read or written) names the least limit that works and what it is made of. ``off.plan``
            holds the parts chosen.

    Returns:
        The ``ParameterOffload`` that streams the blocks (``step()``, ``zero_grad()``, ``stats``, ``close()``).

    Raises:
        TypeError: When ``module`` is not an ``nn.Module``, ``optimizer`` is not callable or
            ``serve_from_checkpoint`` is not a bool.
        ValueError: When an argument is out of range: an unknown ``mode``, a negative or non-integer
            ``prefetch``, a non-floating-point ``compute_dtype``, a block that is not a submodule, no blocks with
            parameters, a block offloaded twice, ``serve_from_checkpoint`` without ``checkpoint``, ``data_parallel``
            with a meta model but no strict checkpoint, or ``init``/``dtype`` for a module without meta tensors.
        UnsupportedError: When a block was compiled (``block.compile()``) before offloading: call it after.

    Examples:
        >>> import torch, deepoffload
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> x = torch.randn(4, 8)
        >>> expected = model(x)
        >>> off = deepoffload.offload_parameters(model, "swap", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> torch.equal(model(x), expected)  # the blocks were read back from storage: same values
        True
        >>> model(x).sum().backward()
        >>> off.step()
        >>> off.zero_grad()
        >>> off.close()  # the trained weights are back in memory
        >>> torch.equal(model(x), expected)
        False
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"offload_parameters: expected an nn.Module, got {type(module).__name__}")
    refuse_wrapped(module)
    if data_parallel is not False:
        process_group(data_parallel)  # raises unless initialised, and for anything but True or a ProcessGroup
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}: expected a number of blocks, 0 or more")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ValueError(f"compute_dtype={compute_dtype!r}: expected a floating-point torch.dtype, e.g. torch.bfloat16")
    if optimizer is not None and not callable(optimizer):
        raise TypeError(
            "optimizer=: expected a factory taking a list of parameters (e.g. a torch.optim class or a "
            f"lambda), got {type(optimizer).__name__}"
        )
    names = {id(m): name for name, m in module.named_modules()}
    if blocks is None:
        chosen = find_blocks(module)
    else:
        chosen = []
        for block in blocks:
            if id(block) not in names:
                raise ValueError(f"blocks=: {type(block).__name__} is not a submodule of the module")
            if all(block is not other for _, other in chosen):  # one module at two places is one block
                chosen.append((names[id(block)], block))
    if not chosen:
        raise ValueError(
            "offload_parameters: no blocks with parameters found (no nn.ModuleList/nn.Sequential "
            "children); pass blocks=[...] explicitly"
        )
    compiled = [name for name, b in chosen if getattr(b, "_compiled_call_impl", None) is not None]
    if compiled:
        raise UnsupportedError(
            f"offload_parameters: blocks {compiled[:5]} were compiled (block.compile()) before offloading; their "
            f"compiled code would not see the streamed parameters and they would run uncompiled. Offload the model "
            f"first, then call block.compile() on each streamed block: its compiled forward then runs with the "
            f"block's parameters resident"
        )
    if any(b.__dict__.get("forward") is not None for _, b in chosen):
        raise ValueError("offload_parameters: a block's forward is already replaced (offloaded twice?)")
    check_arguments(checkpoint, init, dtype, strict)
    if not isinstance(serve_from_checkpoint, bool):
        raise TypeError(f"serve_from_checkpoint=: expected True or False, got {serve_from_checkpoint!r}")
    if serve_from_checkpoint and checkpoint is None:
        raise ValueError(
            "serve_from_checkpoint=True needs checkpoint=: the safetensors file or folder to serve "
            "the blocks' parameters from"
        )
    check_budget(max_resident_bytes)  # before any block is made or read
    config = config or SwapConfig()
    if path is not None:
        config = config.replace(folder=path)
    materializer = None
    if data_parallel is not False and has_meta(module) and (checkpoint is None or not strict):
        raise ValueError(
            "data_parallel= with a model on the meta device needs checkpoint= and strict=True: values "
            "made by init= (random) would differ between the ranks. Build the model in memory (its "
            "values are taken from the first rank, as DDP does) or load it from one checkpoint"
        )
    if checkpoint is not None or has_meta(module):
        materializer = Materializer(
            module,
            [name for name, _ in chosen],
            checkpoint=checkpoint,
            init=init,
            dtype=dtype,
            strict=strict,
            serve=serve_from_checkpoint,
        )
    elif init is not None or dtype is not None:
        raise ValueError(
            "init= and dtype= apply to tensors on the meta device, and this module has none: "
            "initialize or convert it before offload_parameters()"
        )
    state_chunks = STATE_CHUNKS
    if max_memory is not None:
        try:
            fitted = fit_limit(
                module,
                chosen,
                max_memory,
                prefetch=prefetch,
                training=optimizer is not None,
                reading=checkpoint is not None,
                max_resident_bytes=max_resident_bytes,
                layout_of=materializer.layout_of if materializer is not None else None,
            )
        except BaseException:
            if materializer is not None:
                materializer.undo()
            raise
        prefetch, state_chunks = fitted.plan.prefetch, fitted.plan.state_chunks
        max_resident_bytes = fitted.plan.resident_bytes or None
    try:
        return ParameterOffload(
            module,
            chosen,
            prefetch=prefetch,
            mode=mode,
            optimizer=optimizer,
            compute_dtype=compute_dtype,
            config=config,
            materializer=materializer,
            max_resident_bytes=max_resident_bytes,
            data_parallel=data_parallel,
            state_chunks=state_chunks,
        )
    except BaseException:
        if materializer is not None:
            materializer.undo()
        raise


def fit_limit(
    module: nn.Module,
    blocks: Sequence[tuple[str, nn.Module]],
    max_memory: int | str,
    *,
    prefetch: int,
    training: bool,
    reading: bool,
    max_resident_bytes: int | None,
    layout_of: Callable[[torch.Tensor], tuple[int, ...] | None] | None = None,
) -> Fitted:
    """The settings for ``max_memory`` (see ``offload_parameters``).

    Args:
        module: The model being offloaded.
        blocks: The chosen blocks as (qualified name, submodule); their tensors may be on meta.
        max_memory: The limit, in bytes or as a string ("6GB").
        prefetch: The most blocks read ahead.
        training: Whether an optimizer steps (its staging buffers count).
        reading: Whether a checkpoint is read (its reader's buffers count).
        max_resident_bytes: The most bytes of blocks kept in memory (None: as many as fit).
        layout_of: A parameter's strides when not row-major, else None (default ``dense_layout``; for a model on
            meta, ``Materializer.layout_of``).

    Returns:
        The plan fitted from the blocks' sizes and this process's memory now.
    """
    from .blocks.residency import dense_layout, nbytes, span

    layout = layout_of or dense_layout
    limit = parse_bytes(max_memory)
    if training:  # a torch optimizer's first construction imports torch._dynamo (about 65 MiB): count it now
        import torch._dynamo  # noqa: F401
    in_blocks = {id(p) for _, b in blocks for p in b.parameters()}
    rest = nbytes(p for p in module.parameters() if id(p) not in in_blocks) + nbytes(module.buffers())
    plan = MemoryPlan(
        max(span(b.parameters()) for _, b in blocks),
        rest,
        prefetch,
        training=training,
        resident_bytes=max_resident_bytes,
        reader_bytes=READER_BYTES if reading else 0,
        layout_bytes=max(nbytes(p for p in b.parameters() if layout(p) is not None) for _, b in blocks),
    )
    return fit(plan, limit, process_bytes())
