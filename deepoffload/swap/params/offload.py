"""``ParameterOffload`` (what ``offload_parameters`` returns): hooks the blocks, makes each resident as it runs
(prefetching per ``schedule``), hands training calls to ``recompute`` and finished gradients to the mode in
``training``; every move of a block's memory goes through ``BlockStore`` as a checked ``Residency`` transition."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import ClosedError
from ...formats.writer import save_sharded
from .. import grad_norm
from ..config import SwapConfig
from ..optimizer import OffloadedOptimizer
from ..pool import PAGE_SIZE
from .blocks import find_blocks
from .materialize import Init, Materializer, check_arguments, has_meta
from .placeholders import internal, internal_call
from .recompute import BlockCall, Recompute
from .residency import Block, Residency, nbytes
from .schedule import upcoming
from .store import BlockStore
from .training import MODES as TRAINING_MODES

MODES = tuple(TRAINING_MODES)
OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def _casting(forward: Callable, dtype: torch.dtype) -> Callable:
    """``forward`` with its floating-point tensor arguments cast to ``dtype`` and its ``dtype`` outputs cast back
    to the dtype of its first floating-point argument (so an fp32 model can stream blocks computing in bf16)."""
    def cast(x: Any, to: torch.dtype, only: torch.dtype | None = None) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and (only is None or x.dtype == only):
            return x.to(to)
        return x

    def run(*args, **kwargs):
        flat = pytree.tree_leaves((args, kwargs))
        outer = next((x.dtype for x in flat if isinstance(x, torch.Tensor) and x.is_floating_point()), dtype)
        args, kwargs = pytree.tree_map(lambda x: cast(x, dtype), (args, kwargs))
        return pytree.tree_map(lambda x: cast(x, outer, only=dtype), forward(*args, **kwargs))

    return run


@dataclass(frozen=True)
class OffloadStats:
    """Figures of a ``ParameterOffload`` since it was made (or since ``reset_peak`` for the peaks). Bytes, seconds.

    bytes_read / bytes_written: storage traffic of block parameters and gradients.
    state_bytes_read / state_bytes_written: storage traffic of the offloaded optimizer state.
    io_wait_seconds: time the calling thread was blocked on parameter and gradient reads and writes.
    optimizer_seconds: time spent in optimizer steps of blocks (their state IO included).
    resident_bytes / peak_bytes: block parameter bytes in memory now / at most: staging buffers being read, in use
        or being written, plus compute-dtype copies. Parameters outside blocks are ``rest_bytes`` (always resident).
    grad_bytes / peak_grad_bytes: block gradient bytes in memory (before they reach storage or the optimizer).
    block_bytes: the largest block's parameter bytes in memory when resident (stored dtype plus compute copy).
    rest_bytes: parameters outside blocks (always in memory).
    staging_bytes: pooled staging buffers held now, for parameters and optimizer state (reused, page-aligned).
    """

    bytes_read: int
    bytes_written: int
    state_bytes_read: int
    state_bytes_written: int
    io_wait_seconds: float
    optimizer_seconds: float
    resident_bytes: int
    peak_bytes: int
    grad_bytes: int
    peak_grad_bytes: int
    block_bytes: int
    rest_bytes: int
    staging_bytes: int


class ParameterOffload:
    """The handle ``offload_parameters`` returns: streams the blocks' parameters, steps them when training, and
    reports ``stats``. Use ``step()`` after each backward and ``zero_grad()`` as with an optimizer; ``close()``
    ends offloading (by default reading the parameters back into memory first)."""

    def __init__(self, module: nn.Module, blocks: Sequence[tuple[str, nn.Module]], *, prefetch: int, mode: str,
                 optimizer: OptimizerFactory | None, compute_dtype: torch.dtype | None, config: SwapConfig,
                 materializer: Materializer | None = None, max_resident_bytes: int | None = None):
        self.module = module
        self.prefetch = prefetch
        self.mode = mode
        self.compute_dtype = compute_dtype
        self.blocks = [Block(i, prefix, block, compute_dtype) for i, (prefix, block) in enumerate(blocks)]
        self._check_sharing()
        serving = materializer is not None and materializer.serve
        self.store = BlockStore(self.blocks, prefetch, config, slack=PAGE_SIZE if serving else 0)
        self.swapper = self.store.swapper
        in_blocks = {id(p) for b in self.blocks for p in b.params}
        self.rest = [p for p in module.parameters() if id(p) not in in_blocks]
        self._rest_named = [(n, p) for n, p in module.named_parameters() if id(p) not in in_blocks]
        # a block's state (Adam: about two block spans, 3 chunks) read ahead during its backward, plus the chunks of
        # its step being written: 6 chunks of a block span; with more state per block, reads wait for those writes
        state_config = config.replace(chunk_bytes=self.store.block_span, buffer_count=6)
        block_optimizer = rest_optimizer = None
        if optimizer is not None:
            masters = [m for b in self.blocks for m in b.masters if m.requires_grad]
            block_optimizer = OffloadedOptimizer(optimizer, masters, state_config) if masters else None
            rest = [p for p in self.rest if p.requires_grad]
            rest_optimizer = OffloadedOptimizer(optimizer, rest, state_config) if rest else None
        self._block_optimizer, self._rest_optimizer = block_optimizer, rest_optimizer
        # the parameters the optimizers step: one frozen at this call and unfrozen later is not among them
        self._optimizing = optimizer is not None
        self._stepped_ids = self._optimized_ids()
        self.training = TRAINING_MODES[mode](module, self.store, prefetch, self.rest, block_optimizer,
                                             rest_optimizer)
        self._token = torch.empty(0, requires_grad=True)
        self._closed = False
        # what the checkpoint lacked / had beyond the model (strict=False), when loaded from one
        self.load_report = materializer.report if materializer is not None else None
        if materializer is None:
            self.store.offload_all()
        else:
            materializer.offload(self.store, self.blocks)
        self.set_max_resident_bytes(max_resident_bytes)
        self._patched: list[tuple[nn.Module, str, Callable]] = []
        self._hooks = []
        for block in self.blocks:
            self._patch(block)
        self._guard_moves()

    # -- setup ---------------------------------------------------------------------------------------------
    @property
    def pinned(self) -> frozenset[int]:
        """Indices of the blocks held in memory by ``max_resident_bytes``."""
        return frozenset(b.index for b in self.blocks if b.state is Residency.PINNED)

    @internal_call
    def set_max_resident_bytes(self, budget: int | None) -> None:
        """Keep in memory the blocks that fit in ``budget`` bytes (stored plus compute copy), taken in block order
        (every block is read once per sweep anyway, and the first ones' reads are the least hidden behind compute);
        the rest stream. Pinned blocks are read once, outside the staging pool, never released by the schedule, and
        step in memory (no write, no read back per step). A block leaving the budget is written first (its values
        in memory are the valid copy); a failed write raises and keeps it in memory. 0 or None: stream every block.
        Call between steps."""
        _check_budget(budget)
        self._check_open()
        budget = budget or 0
        self.training.finish_writes()
        self.store.wait_writes()
        chosen = []
        for block in self.blocks:
            need = block.nbytes + block.compute_nbytes
            if need <= budget:
                chosen.append(block)
                budget -= need
        keep = {b.index for b in chosen}
        for block in self.blocks:
            if block.index not in keep:
                self.store.unpin(block)
        for block in chosen:
            self.store.pin(block)
        self._guard_grads()

    def _check_sharing(self) -> None:
        """Refuse a parameter shared between two blocks, or between a block and the rest of the module."""
        owner: dict[int, str] = {}
        for block in self.blocks:
            for name, param in zip(block.names, block.params):
                other = owner.setdefault(id(param), block.qualified(name))
                if other != block.qualified(name):
                    raise ValueError(f"parameter {block.qualified(name)} is the same tensor as {other} in another "
                                     f"block: shared parameters must stay in memory; choose blocks= without them")
        prefixes = tuple(b.prefix + "." for b in self.blocks)
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if id(param) in owner and not name.startswith(prefixes):
                raise ValueError(f"parameter {name} (outside the blocks) is the same tensor as {owner[id(param)]} "
                                 f"in a block: shared parameters must stay in memory; choose blocks= without it")

    def _patch(self, block: Block) -> None:
        forward = block.module.forward
        if block.compute_dtype is not None:
            forward = _casting(forward, block.compute_dtype)

        def streamed_forward(*args, **kwargs):
            if torch.compiler.is_compiling():
                # torch.compile: the block runs eagerly (its parameters change shape as they are streamed), the
                # rest compiles; the compiler is imported only by then (importing it costs about 90 MB)
                return torch.compiler.disable(self._run)(block, forward, args, kwargs)
            return self._run(block, forward, args, kwargs)

        block.module.forward = streamed_forward
        self._patched.append((block.module, "forward", streamed_forward))
        self._hooks.append(block.module.register_state_dict_pre_hook(self._block_state_dict_start(block)))
        self._hooks.append(block.module.register_state_dict_post_hook(self._block_state_dict(block)))

    @staticmethod
    def _block_state_dict_start(block: Block) -> Callable:
        def hook(module, prefix, keep_vars) -> None:
            block.exporting += 1  # its parameters' detach() is allowed until the post hook replaces the results
        return hook

    def _block_state_dict(self, block: Block) -> Callable:
        def hook(module, state_dict, prefix, local_metadata) -> None:
            # the block's parameters as stored (master values), read block by block when on storage
            block.exporting = max(block.exporting - 1, 0)
            with internal():
                self.store.wait_write(block)
                copies = self.store.read_copy(block)
            for name, tensor in copies.items():
                if prefix + name in state_dict:
                    state_dict[prefix + name] = tensor
        return hook

    def _guard_moves(self) -> None:
        """``model.to(dtype)``, ``.half()``, ``.double()``, ``.cuda()`` ... on the module or any module holding
        a block: refused before anything is converted when they would change a streamed parameter."""
        holders = set()
        for name, _ in ((b.prefix, b) for b in self.blocks):
            parts = name.split(".") if name else []
            for k in range(len(parts) + 1):
                holders.add(".".join(parts[:k]))
        for name, sub in self.module.named_modules():
            if name in holders:
                original = sub._apply

                def guarded(fn, recurse=True, _original=original):
                    with internal():
                        self._check_move(fn)
                        return _original(fn, recurse)

                sub._apply = guarded
                self._patched.append((sub, "_apply", guarded))

    def _check_move(self, fn: Callable) -> None:
        for block in self.blocks:
            for name, param in zip(block.names, block.params):
                moved = fn(param.data)
                if moved.dtype != param.dtype or moved.device != param.device:
                    raise ValueError(f"this would move the streamed parameter {block.qualified(name)} from "
                                     f"{param.dtype} on {param.device} to {moved.dtype} on {moved.device}, but its "
                                     f"values live on storage: convert or move the model before "
                                     f"offload_parameters(), or pass compute_dtype= to compute blocks in another dtype")

    # -- running blocks (the ``Streamer`` that ``Recompute`` talks to) ---------------------------------------
    def _run(self, block: Block, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if self._closed:
            raise ClosedError(f"block {block.prefix}: its parameters were offloaded by a ParameterOffload closed "
                               f"without restore=True, so they are gone; close(restore=True) keeps them")
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        wants_grad = any(p.requires_grad for p in block.params)
        if not torch.is_grad_enabled() or not (wants_grad or any(t.requires_grad for t in tensors)):
            self.acquire(block, "forward", training=False)
            try:
                return forward(*args, **kwargs)
            finally:
                self.after_forward(block, training=False)
        call = BlockCall(self, block, forward, flat, spec)
        return call.rebuild(Recompute.apply(call, self._token, *tensors))

    def _upcoming(self, index: int, phase: str, training: bool) -> list[int]:
        return upcoming(index, len(self.blocks), self.prefetch, phase, training)

    @internal_call
    def acquire(self, block: Block, phase: str, training: bool) -> None:
        """Make ``block`` resident, start reading its window and release blocks outside it."""
        window = self._upcoming(block.index, phase, training)
        keep = {block.index, *window}
        self.store.check_kept_values(block)  # pinned or kept: a change its masters cannot take raises here
        for other in self.blocks:
            if other.index not in keep:
                self.store.release(other)  # (a no-op for a PINNED block)
        self.store.start_read(block)
        for j in window:
            self.store.start_read(self.blocks[j])
        self.store.materialize(block)
        block.unguard_grads()  # it computes with plain parameters
        if phase == "backward":
            block.restore_grads()

    @internal_call
    def after_forward(self, block: Block, training: bool) -> None:
        if block.index not in self._upcoming(block.index, "forward", training):
            self.store.release(block)
        block.guard_grads()

    @internal_call
    def before_backward(self, call: BlockCall, last: bool) -> bool:
        """Check the backward may run; return whether the block's gradients are complete after it."""
        block = call.block
        if call.steps != block.steps:
            raise RuntimeError(f"block {block.prefix}: backward through a forward made before the block's last "
                               f"optimizer step (its weights changed since; in memory PyTorch would refuse too). "
                               f"Run validation under torch.no_grad(), and backward each forward before step()")
        if block.trainable and block.served:
            raise RuntimeError(f"block {block.prefix}: backward would train parameters that are served read-only "
                               f"from the checkpoint {block.served} (serve_from_checkpoint=True), which is never "
                               f"written: offload without serve_from_checkpoint= to train, or freeze them "
                               f"(requires_grad_(False))")
        self._check_unfrozen(block)
        if block.trainable and self._block_optimizer is None:
            raise RuntimeError(f"block {block.prefix}: backward needs gradients of its parameters but "
                               f"offload_parameters() got no optimizer=: pass optimizer= to train, or freeze the "
                               f"parameters (requires_grad_(False))")
        if last and call.nested and self.training.defers_nested:
            last, block.deferred = False, True  # its gradients wait in memory for step()
        self.training.before_backward(block, last)
        return last

    def _check_unfrozen(self, block: Block) -> None:
        """Refuse a backward once a parameter frozen when the optimizers were made requires a gradient: no optimizer
        holds it, so it would never step (in memory, an optimizer made over ``model.parameters()`` would step it)."""
        if not self._optimizing:
            return
        named = [(block.qualified(n), m) for n, p, m in zip(block.names, block.params, block.masters)
                 if p.requires_grad]
        named += [(n, p) for n, p in self._rest_named if p.requires_grad]
        for name, param in named:
            if id(param) not in self._stepped_ids:
                self._stepped_ids = self._optimized_ids()  # a param group added since?
            if id(param) not in self._stepped_ids:
                raise RuntimeError(f"parameter {name} was frozen when offload_parameters() made the optimizers and "
                                   f"requires a gradient now (requires_grad_(True) after it), so no optimizer would "
                                   f"step it: unfreeze before offload_parameters() (freeze later instead: a frozen "
                                   f"parameter gets no gradient and is not stepped), or offload again")

    def _optimized_ids(self) -> set[int]:
        return {id(p) for o in self.optimizers for group in o.param_groups for p in group["params"]}

    @internal_call
    def after_backward(self, block: Block, last: bool) -> None:
        if last:
            self.training.after_backward(block)
        else:
            block.stash_grads()
            self.store.release(block)
        block.guard_grads()

    @internal_call
    def release(self, block: Block) -> None:
        self.store.release(block)

    # -- steps -------------------------------------------------------------------------------------------------
    @internal_call
    def step(self, clip_grad_norm: float | None = None, norm_type: float = 2.0) -> torch.Tensor | None:
        """Finish a training step after ``backward()``: in grads mode, stream every block through its optimizer
        step; in fused mode, wait for the blocks' write-backs. Then step the parameters outside blocks.

        clip_grad_norm: grads mode only: clip all gradients (blocks' and the rest's) by their global
            ``norm_type``-norm first, exactly as ``torch.nn.utils.clip_grad_norm_(module.parameters(),
            clip_grad_norm, norm_type)`` would (same arithmetic and order, so bit-identical); this costs one extra
            streamed read of the blocks' gradients. Returns that total norm (a 0-dim tensor), else None. Fused mode
            raises ValueError: each block steps inside backward, before the other blocks' gradients exist."""
        self._check_open()
        if self._block_optimizer is None and self._rest_optimizer is None:
            raise ValueError("step(): offload_parameters() got no optimizer=; pass one to train")
        if clip_grad_norm is not None:
            grad_norm.check_clip_args(clip_grad_norm, norm_type)
        for block in self.blocks:
            self.store.check_kept_values(block)  # a change a pinned block's masters cannot take raises before a step
        for block in self.blocks:
            block.unguard_grads()  # blocks in memory step with plain parameters
        try:
            total, coefficient = self.training.step(clip_grad_norm, norm_type)
            self.training.end_step()
            self.store.wait_writes()
        finally:
            self._guard_grads()  # gradients a failure left away stay refused
        if self._rest_optimizer is not None:
            if coefficient is not None:
                grad_norm.scale_([p.grad for p in self.rest if p.grad is not None], coefficient)
            self._rest_optimizer.step()
        return total

    def _guard_grads(self) -> None:
        for block in self.blocks:
            block.guard_grads()

    @internal_call
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: those outside blocks, and the blocks' gradients on storage (grads mode)."""
        self._check_open()
        self.training.finish_writes()
        if self._rest_optimizer is not None:
            self._rest_optimizer.zero_grad(set_to_none)
        self.training.zero_grad()
        self._guard_grads()

    @internal_call
    def flush(self) -> None:
        """Wait for every write in flight and write out blocks kept in memory after a failed write; raise the
        first failure (those blocks stay in memory)."""
        self._check_open()
        error = None
        for action in (self.training.finish_writes, self.store.wait_writes):
            try:
                action()
            except OSError as e:
                error = error or e
        error = error or self.store.flush_kept()
        if error is not None:
            raise error

    # -- figures, checkpoints, lifetime --------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """Start measuring ``peak_bytes`` and ``peak_grad_bytes`` afresh from what is resident now."""
        self.store.reset_peak()

    @property
    def stats(self) -> OffloadStats:
        state_read = state_written = 0
        for optimizer in self.optimizers:
            state_read += optimizer.swapper.bytes_read
            state_written += optimizer.swapper.bytes_written
        store = self.store
        return OffloadStats(
            bytes_read=self.swapper.bytes_read, bytes_written=self.swapper.bytes_written,
            state_bytes_read=state_read, state_bytes_written=state_written,
            io_wait_seconds=store.io_wait, optimizer_seconds=self.training.optimizer_seconds,
            resident_bytes=store.resident_bytes(), peak_bytes=store.peak,
            grad_bytes=store.grad_bytes, peak_grad_bytes=store.peak_grad,
            block_bytes=max((b.nbytes + b.compute_nbytes for b in self.blocks), default=0),
            rest_bytes=nbytes(self.rest),
            staging_bytes=self.swapper.pool.held_bytes() + sum(o.swapper.pool.held_bytes() for o in self.optimizers))

    @property
    def optimizers(self) -> list[OffloadedOptimizer]:
        """The optimizers in use (blocks, then the rest), e.g. to attach LR schedulers to each."""
        return [o for o in (self._block_optimizer, self._rest_optimizer) if o is not None]

    @internal_call
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()``: the blocks' parameters are read from storage one block at a time (copies,
        master dtype); ``module.state_dict()`` itself does the same."""
        self._check_open()
        self.store.wait_writes()
        return self.module.state_dict()

    @internal_call
    def save(self, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 10**9) -> list[Path]:
        """Write the module's state as safetensors shards with an index (Hugging Face layout, through the async-IO
        op) into the folder ``path``, reading the blocks from storage one at a time (master values), so the model is
        never resident. Holds what ``state_dict()`` holds (parameters, persistent buffers) except that a tensor
        shared under several names is written once, under its first name (safetensors cannot store shared tensors;
        ``from_pretrained`` ties them again). A module with a Hugging Face ``config`` also gets its
        ``config.json``, so ``from_pretrained(path)`` loads the result. Returns the shard paths."""
        self._check_open()
        self.training.finish_writes()
        self.store.wait_writes()
        shards = save_sharded(self._state_items(), path, max_shard_bytes=max_shard_bytes)
        config = getattr(self.module, "config", None)
        if callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(path)
        return shards

    def _state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of the module's persistent state in ``state_dict()`` order, each block read when reached."""
        blocks = {b.prefix: b for b in self.blocks}
        seen: set[int] = set()

        def own(module: nn.Module, prefix: str, skip_params: bool) -> Iterator[tuple[str, torch.Tensor]]:
            if not skip_params:
                for name, param in module._parameters.items():
                    if param is not None and id(param) not in seen:
                        seen.add(id(param))
                        yield prefix + name, param.detach()
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set and id(buffer) not in seen:
                    seen.add(id(buffer))
                    yield prefix + name, buffer

        def visit(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
            block = blocks.get(prefix[:-1])
            if block is not None and block.module is module:
                values = self.store.read_copy(block)
                for name, param in zip(block.names, block.params):
                    if id(param) not in seen:
                        seen.add(id(param))
                        yield block.qualified(name), values[name]
                del values
                for name, sub in module.named_modules(prefix=prefix[:-1]):
                    yield from own(sub, name + ".", skip_params=True)
                return
            yield from own(module, prefix, skip_params=False)
            for name, child in module.named_children():
                yield from visit(child, f"{prefix}{name}.")

        yield from visit(self.module, "")

    @internal_call
    def close(self, restore: bool = True) -> None:
        """End offloading: finish writes, unhook the blocks and remove the swap files and optimizer state files.

        restore: True (the default): first read every block back into memory (master dtype), so the module holds
            its trained weights and works as before; this needs memory for the whole model (pinned blocks keep
            theirs, uncopied). If a block cannot be read, this raises and nothing is closed. False: discard them
            (take ``state_dict()`` first to keep them); calling a block then raises; blocks held in memory (pinned,
            or kept after a failed write) free theirs with the module."""
        if self._closed:
            return
        if restore:  # a failure here (a block unreadable) leaves everything open and as it was
            for block in self.blocks:
                if block.in_memory and block.unwritable(block.changed()):
                    self.store.drop_unwritable(block)  # raises: a change that cannot be kept must not pass silently
            self.training.finish_writes()
            self.store.wait_writes()
            # a pinned block's memory is its own: it becomes the parameters' (no copy)
            values = [block.master_tensors() if block.state is Residency.PINNED else self.store.read_copy(block)
                      for block in self.blocks]
        try:
            if restore:
                for block, tensors in zip(self.blocks, values):
                    self.store.restore(block, tensors)
            else:
                self.training.finish_writes()
                self.store.wait_writes()
                for block in self.blocks:
                    self.store.release(block, keep_changes=False)
                    block.discarded = True
        finally:
            self._closed = True
            for block in self.blocks:
                block.unguard_grads()
            for hook in self._hooks:
                hook.remove()
            for module, attribute, patched in self._patched:
                if attribute == "forward" and not restore:
                    continue  # calls keep failing with a clear error
                if module.__dict__.get(attribute) is patched:
                    delattr(module, attribute)
            self.swapper.close()
            for optimizer in self.optimizers:
                optimizer.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this ParameterOffload is closed")

    def __enter__(self) -> "ParameterOffload":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_budget(budget: object) -> None:
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise ValueError(f"max_resident_bytes={budget!r}: expected a number of bytes, 0 or more")


def offload_parameters(module: nn.Module, path: str | None = None, *, blocks: Sequence[nn.Module] | None = None,
                       prefetch: int = 1, mode: str = "fused", optimizer: OptimizerFactory | None = None,
                       compute_dtype: torch.dtype | None = None, config: SwapConfig | None = None,
                       checkpoint: str | os.PathLike | None = None, init: Init | None = None,
                       dtype: torch.dtype | None = None, strict: bool = True,
                       max_resident_bytes: int | None = None,
                       serve_from_checkpoint: bool = False) -> ParameterOffload:
    """Move the parameters of ``module``'s blocks to storage and stream them in as the blocks run.

    path: the folder for swap files (default: ``config.folder``, else the temp folder); each run gets its own
        sub-folder, removed on ``close()``.
    blocks: the submodules to stream (default: see ``find_blocks``), in the order they run.
    prefetch: how many blocks ahead are read while one computes (0: read each block when it starts).
    mode: "fused" (optimizer step inside backward, memory-minimal) or "grads" (gradients to storage, ``step()``
        streams); see the package docstring.
    optimizer: to train, a factory called with a list of parameters that returns a ``torch.optim.Optimizer``
        (e.g. ``lambda ps: torch.optim.AdamW(ps, lr=1e-4)``); called once for the blocks' master weights and once
        for the parameters outside blocks; their state is offloaded too. None: inference only.
    compute_dtype: blocks compute in this dtype while their stored (master) weights keep theirs.
    config: a ``SwapConfig`` (async-IO settings, pinning, checksums); buffer sizes are chosen here.
    checkpoint: load the module's values from this checkpoint (a ``.safetensors`` file, a Hugging Face sharded
        folder with its index, or a ``torch.save`` state dict) block by block while offloading, converting floating
        point dtypes to the module's; names and shapes are checked first (``CheckpointError`` listing every
        missing, unexpected or mis-shaped name; ``strict=False`` allows missing and unexpected ones, reported in
        ``load_report``). Needed for no model: a module built on the ``meta`` device works without it too.
    init: for a module with tensors on the ``meta`` device that no checkpoint gives: called with each module
        owning such tensors, children before parents (e.g. a Hugging Face model's ``_init_weights``); default: the
        module's ``reset_parameters()``. A value left unset is an error. See ``materialize``.
    dtype: floating-point parameters made from ``meta`` get this dtype (like ``from_pretrained``'s ``torch_dtype``);
        buffers keep the dtype they were built with (as under accelerate's ``init_empty_weights()``).
    strict: see checkpoint.
    max_resident_bytes: blocks whose parameters (stored plus compute copy) fit in this many bytes stay in memory
        and are never re-read by the schedule, the first blocks first; the rest stream. Pinned blocks also step in
        memory, never written or read back. With the model's size, inference and training read and write no
        parameter bytes after setup. See ``ParameterOffload.set_max_resident_bytes``.
    serve_from_checkpoint: for inference: blocks whose parameters lie in the (safetensors) ``checkpoint`` in the
        model's dtype, back to back in one file, are read from there and never copied to ``path``; the others are
        copied as usual. The checkpoint is never written: a backward that would train a served block raises, and
        so does releasing one whose parameters user code changed (the change is dropped).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"offload_parameters: expected an nn.Module, got {type(module).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}: expected a number of blocks, 0 or more")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ValueError(f"compute_dtype={compute_dtype!r}: expected a floating-point torch.dtype, e.g. "
                         f"torch.bfloat16")
    if optimizer is not None and not callable(optimizer):
        raise TypeError("optimizer=: expected a factory taking a list of parameters (e.g. a torch.optim class or a "
                        f"lambda), got {type(optimizer).__name__}")
    names = {id(m): name for name, m in module.named_modules()}
    if blocks is None:
        chosen = find_blocks(module)
    else:
        chosen = []
        for block in blocks:
            if id(block) not in names:
                raise ValueError(f"blocks=: {type(block).__name__} is not a submodule of the module")
            chosen.append((names[id(block)], block))
    if not chosen:
        raise ValueError("offload_parameters: no blocks with parameters found (no nn.ModuleList/nn.Sequential "
                         "children); pass blocks=[...] explicitly")
    if any(b.__dict__.get("forward") is not None for _, b in chosen):
        raise ValueError("offload_parameters: a block's forward is already replaced (offloaded twice?)")
    check_arguments(checkpoint, init, dtype, strict)
    if not isinstance(serve_from_checkpoint, bool):
        raise TypeError(f"serve_from_checkpoint=: expected True or False, got {serve_from_checkpoint!r}")
    if serve_from_checkpoint and checkpoint is None:
        raise ValueError("serve_from_checkpoint=True needs checkpoint=: the safetensors file or folder to serve "
                         "the blocks' parameters from")
    _check_budget(max_resident_bytes)  # before any block is made or read
    config = config or SwapConfig()
    if path is not None:
        config = config.replace(folder=path)
    materializer = None
    if checkpoint is not None or has_meta(module):
        materializer = Materializer(module, [name for name, _ in chosen], checkpoint=checkpoint, init=init,
                                    dtype=dtype, strict=strict, serve=serve_from_checkpoint)
    elif init is not None or dtype is not None:
        raise ValueError("init= and dtype= apply to tensors on the meta device, and this module has none: "
                         "initialize or convert it before offload_parameters()")
    try:
        return ParameterOffload(module, chosen, prefetch=prefetch, mode=mode, optimizer=optimizer,
                                compute_dtype=compute_dtype, config=config, materializer=materializer,
                                max_resident_bytes=max_resident_bytes)
    except BaseException:
        if materializer is not None:
            materializer.undo()
        raise
