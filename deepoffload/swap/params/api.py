"""``offload_parameters``, the entry point of parameter offload.

It takes its options as objects (``options``), chooses the blocks and builds a ``ParameterOffload``.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch
from torch import nn

from ...errors import UnsupportedError
from ..config import SwapConfig
from .blocks.finding import find_blocks
from .budget import READER_BYTES, STATE_CHUNKS, Fitted, MemoryPlan, encoded_bytes, fit, parse_bytes, process_bytes
from .guards.wrappers import refuse_wrapped
from .offload import ParameterOffload
from .options import LoadOptions, StreamOptions, TrainOptions, check_options, moved_keywords
from .setup.materialize import Materializer, has_meta
from .training.data_parallel import process_group


@moved_keywords
def offload_parameters(
    module: nn.Module,
    path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    blocks: Sequence[nn.Module] | None = None,
    train: TrainOptions | None = None,
    load: LoadOptions | None = None,
    stream: StreamOptions | None = None,
    config: SwapConfig | None = None,
) -> ParameterOffload:
    """Move the parameters of ``module``'s blocks to storage and stream them in as the blocks run.

    Options come grouped in objects, each checked when made: ``TrainOptions`` (optimizer, mode, data parallel),
    ``LoadOptions`` (checkpoint, initializer, dtype, serving from the checkpoint) and ``StreamOptions`` (prefetch,
    compute dtype, blocks kept in memory, memory limit). A keyword these replaced (``optimizer=``, ``checkpoint=``,
    ``prefetch=``, ...) is a ``TypeError`` naming its object.

    Args:
        module: The model whose blocks are offloaded.
        path: The folder for swap files (default: ``config.folder``, else the temp folder); each run gets its own
            sub-folder, removed on ``close()``. A list of folders (one per drive) spreads the blocks and their
            optimizer state over every drive (``SwapConfig.folder``).
        blocks: The submodules to stream (default: see ``find_blocks``), in the order they run; a module at two
            places in the model (or listed twice) is one block, run at each place.
        train: To train, a ``TrainOptions`` (its optimizer's state is offloaded too). None: inference only.
        load: Where the values come from (a checkpoint read block by block, an initializer for a module on the
            ``meta`` device, its dtype); see ``LoadOptions``. None: the module's own values (a module built on the
            ``meta`` device is then initialized by its own initializers).
        stream: How the blocks stream (see ``StreamOptions``; None: its defaults, one block read ahead).
        config: A ``SwapConfig`` (async-IO settings, pinning, checksums); buffer sizes are chosen here.

    Returns:
        The ``ParameterOffload`` that streams the blocks (``step()``, ``zero_grad()``, ``stats``, ``close()``).

    Raises:
        TypeError: When ``module`` is not an ``nn.Module``, an options keyword is not its object, or a keyword
            moved into one is given (the message names the object and field).
        ValueError: When a block is not a submodule, no block has parameters, a block is offloaded twice,
            ``serve_from_checkpoint`` is set without a ``checkpoint``, ``data_parallel`` is set for a meta model
            without a strict checkpoint, or ``init``/``dtype`` is given for a module without meta tensors.
        UnsupportedError: When a block was compiled (``block.compile()``) before offloading: call it after.

    Examples:
        >>> import torch, deepoffload
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> x = torch.randn(4, 8)
        >>> expected = model(x)
        >>> sgd = deepoffload.TrainOptions(lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> off = deepoffload.offload_parameters(model, "swap", train=sgd)
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
    check_options(load=load, train=train, stream=stream)
    load = load or LoadOptions()
    stream = stream or StreamOptions()
    data_parallel = train.data_parallel if train is not None else False
    refuse_wrapped(module)
    if data_parallel is not False:
        process_group(data_parallel)  # raises unless torch.distributed is initialised
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
    checkpoint = load.checkpoint
    if load.serve_from_checkpoint and checkpoint is None:
        raise ValueError(
            "LoadOptions(serve_from_checkpoint=True) needs checkpoint=: the safetensors file or folder to serve "
            "the blocks' parameters from"
        )
    config = config or SwapConfig()
    if path is not None:
        config = config.replace(folder=path)
    materializer = None
    if data_parallel is not False and has_meta(module) and (checkpoint is None or not load.strict):
        raise ValueError(
            "TrainOptions(data_parallel=...) with a model on the meta device needs LoadOptions(checkpoint=..., "
            "strict=True): values made by init= (random) would differ between the ranks. Build the model in "
            "memory (its values are taken from the first rank, as DDP does) or load it from one checkpoint"
        )
    if (load.init is not None or load.dtype is not None) and not has_meta(module):  # with a checkpoint too
        given = "init=" if load.dtype is None else f"dtype={load.dtype}"
        raise ValueError(
            f"LoadOptions({given}) applies to tensors on the meta device, and this module has none, so it would be "
            f"ignored: initialize or convert the module before offload_parameters() (e.g. module.to(dtype)), or build "
            f"it on the meta device (with torch.device('meta'): ...)"
        )
    if checkpoint is not None or has_meta(module):
        materializer = Materializer(
            module,
            [name for name, _ in chosen],
            checkpoint=checkpoint,
            init=load.init,
            dtype=load.dtype,
            strict=load.strict,
            serve=load.serve_from_checkpoint,
        )
    prefetch, max_resident_bytes, state_chunks = stream.prefetch, stream.max_resident_bytes, STATE_CHUNKS
    if stream.max_memory is not None:
        try:
            fitted = fit_limit(
                module,
                chosen,
                stream.max_memory,
                prefetch=prefetch,
                training=train is not None,
                reading=checkpoint is not None,
                max_resident_bytes=max_resident_bytes,
                layout_of=materializer.layout_of if materializer is not None else None,
                codec=config.codec,
            )
        except BaseException:
            if materializer is not None:
                materializer.undo()
            raise
        prefetch, state_chunks = fitted.plan.prefetch, fitted.plan.state_chunks
        max_resident_bytes = fitted.plan.resident_bytes or None
    try:
        offload = ParameterOffload(
            module,
            chosen,
            prefetch=prefetch,
            mode=train.mode if train is not None else "fused",
            optimizer=train.optimizer if train is not None else None,
            compute_dtype=stream.compute_dtype,
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
    offload.keep_graphs = not stream.recompute
    return offload


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
    codec: str = "none",
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
        codec: ``SwapConfig.codec`` (a codec's encoded bytes count beside each block's staging buffer).

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
    largest = max(span(b.parameters()) for _, b in blocks)
    plan = MemoryPlan(
        largest,
        rest,
        prefetch,
        training=training,
        resident_bytes=max_resident_bytes,
        reader_bytes=READER_BYTES if reading else 0,
        layout_bytes=max(nbytes(p for p in b.parameters() if layout(p) is not None) for _, b in blocks),
        stored_bytes=encoded_bytes(codec, largest),
    )
    return fit(plan, limit, process_bytes())
