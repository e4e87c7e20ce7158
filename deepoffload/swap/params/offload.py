"""``ParameterOffload``, what ``offload_parameters`` returns.

It hooks the blocks (``patches``), makes each resident as it runs (prefetching per ``schedule``), hands training calls
to ``recompute`` and finished gradients to the mode in ``training``; every move of a block's memory goes through
``BlockStore`` as a checked ``Residency`` transition.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import ClosedError
from ...formats.writer import save_sharded
from ..config import SwapConfig
from ..optimizer import OffloadedOptimizer
from ..pool import PAGE_SIZE, trim_heap
from ..scaled_losses import LossGraph, watch
from .autograd.recompute import BlockCall, Recompute
from .autograd.shared_inputs import SharedInputs
from .blocks.experts import ExpertReads
from .blocks.patches import ModulePatches
from .blocks.placeholders import internal_call
from .blocks.residency import Block, Residency, dense_layout, nbytes
from .blocks.resident_set import ResidentSet
from .blocks.schedule import upcoming
from .budget import READER_BYTES, STATE_CHUNKS, MemoryPlan, encoded_bytes
from .guards.refusals import check_backward, check_budget, check_sharing, scaled_loss_error
from .guards.structure import Structure
from .setup.materialize import Materializer
from .setup.model_rules import rules_for
from .stats import OffloadStats
from .storage import closing
from .storage.export import save_config, state_items
from .storage.store import BlockStore
from .training.data_parallel import DataParallel, GradientAverager, process_group
from .training.modes import MODES as TRAINING_MODES
from .training.optimizers import OptimizerFactory, Optimizers
from .training.stepping import Stepper

MODES = tuple(TRAINING_MODES)


class ParameterOffload:
    """The handle ``offload_parameters`` returns: streams the blocks' parameters, steps them when training.

    It also reports ``stats``. Use ``step()`` after each backward and ``zero_grad()`` as with an optimizer; ``close()``
    ends offloading (by default reading the parameters back into memory first). Also a context manager that closes on
    exit. Made by ``offload_parameters``, which checks the arguments first.

    Args:
        module: The model whose blocks are streamed.
        blocks: The blocks as (qualified name, submodule), in the order they run.
        prefetch: How many blocks ahead are read while one computes.
        mode: "fused" or "grads" (see ``offload_parameters``).
        optimizer: The optimizer factory (see ``offload_parameters``); None: inference only.
        compute_dtype: The dtype blocks compute in while their stored weights keep theirs (None: their own).
        config: The async-IO settings; the swap files go under its ``folder``.
        materializer: For a module on the ``meta`` device or loaded from a checkpoint: makes the blocks' values
            block by block straight to storage (None: the values in memory are offloaded).
        max_resident_bytes: Bytes of blocks kept in memory (see ``set_max_resident_bytes``).
        data_parallel: False, True (the default process group) or a ``ProcessGroup`` (see
            ``offload_parameters``).
        state_chunks: How many staging buffers of a block's size the blocks' optimizer state gets.

    Raises:
        ValueError: When a parameter is shared between two blocks or between a block and the rest of the module.

    Examples:
        >>> import torch, deepoffload
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)
        >>> off = deepoffload.offload_parameters(model, "swap", train=deepoffload.TrainOptions(sgd, mode="grads"))
        >>> len(off.blocks)
        2
        >>> model(torch.randn(4, 8)).sum().backward()  # gradients go to storage
        >>> off.step(clip_grad_norm=1.0)  # streams each block through SGD; the total norm before clipping
        tensor(...)
        >>> off.zero_grad()
        >>> sorted(off.state_dict())  # the blocks' values, read from storage
        ['0.bias', '0.weight', '2.bias', '2.weight']
        >>> off.close()  # reads the parameters back into memory
    """

    def __init__(
        self,
        module: nn.Module,
        blocks: Sequence[tuple[str, nn.Module]],
        *,
        prefetch: int,
        mode: str,
        optimizer: OptimizerFactory | None,
        compute_dtype: torch.dtype | None,
        config: SwapConfig,
        materializer: Materializer | None = None,
        max_resident_bytes: int | None = None,
        data_parallel: object = False,
        state_chunks: int = STATE_CHUNKS,
    ):
        self.module = module
        self.prefetch = prefetch
        self.mode, self.keep_graphs = mode, False  # keep_graphs: StreamOptions(recompute=False), set after
        self.compute_dtype = compute_dtype
        layout_of = materializer.layout_of if materializer is not None else dense_layout
        self.blocks = [Block(i, p, block, compute_dtype, layout_of) for i, (p, block) in enumerate(blocks)]
        check_sharing(module, self.blocks)
        self.resident_set = ResidentSet(len(self.blocks))  # runs per block: the most-run stay in memory
        serving = materializer is not None and materializer.serve
        self.store = BlockStore(self.blocks, prefetch, config, slack=PAGE_SIZE if serving else 0)
        in_blocks = {id(p) for b in self.blocks for p in b.params}
        self.rest = [p for p in module.parameters() if id(p) not in in_blocks]
        self.rest_named = [(n, p) for n, p in module.named_parameters() if id(p) not in in_blocks]
        rest_bytes = nbytes(self.rest) + nbytes(module.buffers())
        self.plan = MemoryPlan(
            self.store.block_span,
            rest_bytes,
            prefetch,
            training=optimizer is not None,
            state_chunks=state_chunks,
            resident_bytes=max_resident_bytes or 0,
            reader_bytes=READER_BYTES if materializer is not None and materializer.reader else 0,
            layout_bytes=max((b.layout_nbytes for b in self.blocks), default=0),
            stored_bytes=encoded_bytes(config.codec, self.store.block_span),
        )
        # a block's state (Adam: about two block spans, 3 chunks) read ahead during its backward, plus the chunks of
        # its step being written: 6 chunks of a block span; with more state per block, reads wait for those writes.
        # The parameters outside blocks get buffers of their own size when smaller (they grow to their largest chunk)
        packed = config.replace(codec="none")  # the state's packed extents are rewritten in place: bytes as they are
        state_config = packed.replace(chunk_bytes=self.store.block_span, buffer_count=state_chunks)
        rest_config = packed.replace(chunk_bytes=self.plan.rest_chunk_bytes, buffer_count=STATE_CHUNKS)
        self._optimizers = Optimizers(optimizer, self.blocks, self.rest_named, state_config, rest_config)
        block_optimizer, rest_optimizer = self._optimizers.block, self._optimizers.rest
        self.training = TRAINING_MODES[mode](module, self.store, prefetch, self.rest, block_optimizer, rest_optimizer)
        self._stepper = Stepper(self.blocks, self.store, self.training, self.rest, self._optimizers)
        self._token = torch.empty(0, requires_grad=True)
        self._shared = SharedInputs()  # tensors passed to several blocks: their gradients summed as in memory
        self._closed = False
        watch(self)  # a GradScaler's scale() asks scaled_loss_error first
        self.data_parallel = None
        group = process_group(data_parallel) if data_parallel is not False else None
        if data_parallel is not False and materializer is None:  # DDP's construction: the first rank's values
            GradientAverager(group).broadcast([*module.parameters(), *module.buffers()])
        self.load_report = materializer.report if materializer is not None else None
        if materializer is None:
            self.store.offload_all()
        else:
            materializer.offload(self.store, self.blocks)
            if data_parallel is not False:  # the blocks came from one checkpoint; the rest from the first rank
                GradientAverager(group).broadcast([*self.rest, *module.buffers()])
        self.set_max_resident_bytes(max_resident_bytes)
        self.patches = ModulePatches(module, self.blocks, self.store, self._run, self._moved)
        for block in self.blocks:
            self.patches.stream(block)
        self.patches.guard_moves()
        self._structure = Structure(module, self.blocks)
        self.experts = ExpertReads(self.blocks, self.store, rules_for(module).experts(module), lambda: self._budget)
        if data_parallel is not False:  # last: its hooks stay only on a ParameterOffload that was made
            self.data_parallel = DataParallel(group, module, self.rest, [n for n, _ in self.rest_named])
            self.training.average = self.data_parallel.average_block
            self.training.average_start = self.data_parallel.start_block

    # -- setup ---------------------------------------------------------------------------------------------
    @property
    def pinned(self) -> frozenset[int]:
        """Indices of the blocks held in memory by ``max_resident_bytes``."""
        return frozenset(b.index for b in self.blocks if b.state is Residency.PINNED)

    @internal_call
    def set_max_resident_bytes(self, budget: int | None) -> None:
        """Keep in memory the blocks that fit in ``budget`` bytes (stored plus compute copy); the rest stream.

        The most-run blocks are taken, ties in block order (``ResidentSet``: before anything ran, and when every block
        runs once per token, the first blocks first, whose reads are the least hidden behind compute); a forward of an
        offload without an optimizer re-chooses when others have run at least two times more. Pinned blocks are read
        once, outside the staging pool, never released by the schedule, and step in memory (no write, no read back per
        step). A block leaving the budget is written first (its values in memory are the valid copy); a failed write
        raises and keeps it in memory. Call between steps.

        Args:
            budget: The bytes of blocks to keep in memory; 0 or None: stream every block.
        """
        check_budget(budget)
        self._check_open()
        self._budget = budget
        budget = budget or 0
        self.training.finish_writes()
        self.store.wait_writes()
        chosen = self.resident_set.choose(self.blocks, budget)
        keep = {b.index for b in chosen}
        for block in self.blocks:
            if block.index not in keep:
                self.store.unpin(block)
        for block in chosen:
            self.store.pin(block)
        self._stepper.guard_grads()

    # -- running blocks (the ``Streamer`` that ``Recompute`` talks to) ---------------------------------------
    def _run(self, block: Block, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if self._closed:
            raise ClosedError(
                f"block {block.prefix}: its parameters were offloaded by a ParameterOffload closed "
                f"without restore=True, so they are gone; close(restore=True) keeps them"
            )
        self._adopt_adapters(block)
        self._structure.check(block, rest=block.index == 0)  # other parameters added or replaced since offloading
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        wants_grad = any(p.requires_grad for p in block.module.parameters())  # (adapters in memory too)
        if not torch.is_grad_enabled() or not (wants_grad or any(t.requires_grad for t in tensors)):
            self.acquire(block, "forward", training=False)
            try:
                return forward(*args, **kwargs)
            finally:
                self.after_forward(block, training=False)
        given, chained = self._shared.substitute(block.index, tensors)
        call = BlockCall(self, block, forward, flat, spec)
        call.chained = chained
        outputs = Recompute.apply(call, self._token, *given)
        n = len(call.out_positions)
        self._shared.record(tensors, chained, outputs[n:])
        return call.rebuild(outputs[:n])

    def _adopt_adapters(self, block: Block | None = None) -> None:  # adapters added since offloading (Structure.adopt)
        if not self._closed:
            self._structure.adopt(lambda added: self._optimizers.adopt(added, self.rest, self.compute_dtype), block)

    def _upcoming(self, index: int, phase: str, training: bool) -> list[int]:
        return upcoming(index, len(self.blocks), self.prefetch, phase, training)

    def _moved(self) -> None:
        """After blocks were converted to another dtype (``patches``): their new sizes decide which fit the budget."""
        self.training.finish_writes()
        if self.pinned:
            self.set_max_resident_bytes(self._budget)

    @internal_call
    def acquire(self, block: Block, phase: str, training: bool) -> None:
        """Make ``block`` resident, start reading its window and release blocks outside it.

        Args:
            block: The block about to run.
            phase: "forward" or "backward": the pass it runs in, which decides the blocks expected next.
            training: Whether a backward follows the forward (blocks are then expected again in reverse).
        """
        self.resident_set.count(block.index)
        stale = self.resident_set.stale(self.blocks, self._budget or 0, self.pinned)
        if stale and not (training or self.plan.training):  # inference only: no gradients or steps pending
            self.set_max_resident_bytes(self._budget)  # (a block leaving the set is written back first if writable)
        window = self._upcoming(block.index, phase, training)
        keep = {block.index, *window}
        self.store.check_kept_values(block)  # pinned or kept: a change its masters cannot take raises here
        for other in self.blocks:
            if other.index not in keep:
                self.store.release(other)  # (a no-op for a PINNED block)
        partial = phase == "forward" and not training  # (experts read on demand: ``ExpertReads``)
        for j in (block.index, *window):
            self.store.start_read(self.blocks[j], partial)
        self.store.materialize(block)
        block.unguard_grads()  # it computes with plain parameters
        if phase == "backward":
            block.restore_grads()

    @internal_call
    def after_forward(self, block: Block, training: bool) -> None:
        """After ``block``'s forward: release it unless it is expected again soon, and guard its gradients.

        Args:
            block: The block that ran.
            training: Whether a backward follows the forward (see ``acquire``).
        """
        if block.index not in self._upcoming(block.index, "forward", training):
            self.store.release(block)
        block.guard_grads()

    @internal_call
    def before_backward(self, call: BlockCall, last: bool) -> bool:
        """Check the backward may run; return whether the block's gradients are complete after it.

        Args:
            call: The block call about to be back-propagated.
            last: Whether no other call of the block will be back-propagated in this backward.

        Returns:
            Whether the block's gradients are complete after this backward (False for a nested reentrant call whose
            gradients the mode defers to ``step()``).

        Raises:
            StreamedParameterError: When the forward was made before the block's last optimizer step, the block is
                served read-only from the checkpoint and would be trained, or it needs gradients but no
                ``optimizer=`` was given.
        """
        block = call.block
        self._shared.clear()
        check_backward(call, self._optimizers)
        if last and call.nested and self.training.defers_nested:
            last, block.deferred = False, True  # its gradients wait in memory for step()
        self.training.before_backward(block, last)
        return last

    @internal_call
    def after_backward(self, block: Block, last: bool) -> None:
        """After ``block``'s backward: hand complete gradients to the mode, else stash them and release the block.

        Args:
            block: The block whose backward ran.
            last: Whether its gradients are complete (as ``before_backward`` returned).
        """
        if self.data_parallel is not None:
            self.data_parallel.end_of_backward_pending()
        if last:
            self.training.after_backward(block)
        else:
            block.stash_grads()
            self.store.release(block)
        block.guard_grads()
        trim_heap()  # the recompute's block-sized temporaries and gradients, freed now: see trim_heap

    @internal_call
    def release(self, block: Block) -> None:
        """Release ``block``'s memory back to storage (a no-op for a block pinned in memory).

        Args:
            block: The block to release.
        """
        self.store.release(block)

    # -- steps -------------------------------------------------------------------------------------------------
    @internal_call
    def step(self, clip_grad_norm: float | None = None, norm_type: float = 2.0) -> torch.Tensor | None:
        """Finish a training step after ``backward()``.

        In grads mode, stream every block through its optimizer step; in fused mode, wait for the blocks'
        write-backs. Then step the parameters outside blocks.

        Args:
            clip_grad_norm: Grads mode only: clip all gradients (blocks' and the rest's) by their global
                ``norm_type``-norm first, exactly as ``torch.nn.utils.clip_grad_norm_(module.parameters(),
                clip_grad_norm, norm_type)`` would (same arithmetic and order, so bit-identical:
                ``tests/swap/params/test_params_clipping.py::test_clipped_training_bit_identical_to_in_memory``); this
                costs one extra streamed read of the blocks' gradients. Fused mode raises ValueError: each block
                steps inside backward, before the other blocks' gradients exist.
            norm_type: The norm's order for ``clip_grad_norm`` (2.0: Euclidean).

        Returns:
            With ``clip_grad_norm``, the total norm before clipping (a 0-dim tensor), else None.

        Raises:
            ValueError: When ``offload_parameters()`` got no ``optimizer=``.
        """
        self._check_open()
        return self._stepper.step(clip_grad_norm, norm_type)

    @internal_call
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: those outside blocks, and the blocks' gradients on storage (grads mode).

        Args:
            set_to_none: For the gradients outside blocks: set them to None rather than to zero.
        """
        self._check_open()
        self._stepper.zero_grad(set_to_none)

    @internal_call
    def flush(self) -> None:
        """Wait for every write in flight and write out blocks kept in memory after a failed write.

        The first failure (an ``OSError``) is raised once all were tried; those blocks stay in memory.
        """
        self._check_open()
        self._stepper.flush()

    # -- figures, checkpoints, lifetime --------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """Start measuring ``peak_bytes`` and ``peak_grad_bytes`` afresh from what is resident now."""
        self.store.reset_peak()

    def rank_local(self) -> contextlib.AbstractContextManager[None]:
        """Run forwards on this rank alone under ``data_parallel=``, as DDP's ``ddp.module(...)`` does.

        Every forward of a data-parallel model first broadcasts its buffers from the first rank (as DDP does before
        a forward that follows a training one), a collective every rank must join: evaluation on one rank only
        (``if rank == 0: evaluate(model)``) would wait forever for the others. Inside this block no buffer is
        broadcast (the forward uses this rank's own, as ``ddp.module`` would), and a backward raises
        ``UnsupportedError`` (its gradients could not be averaged). Without ``data_parallel=`` it changes nothing.

        Returns:
            A context manager (``with off.rank_local():``); it binds nothing.

        Examples:
            >>> if torch.distributed.get_rank() == 0:  # doctest: +SKIP
            ...     with off.rank_local(), torch.no_grad():
            ...         loss = model(batch).loss
        """
        return contextlib.nullcontext() if self.data_parallel is None else self.data_parallel.rank_local()

    @property
    def stats(self) -> OffloadStats:
        """The offload's figures since it was made (its peaks since ``reset_peak``)."""
        return OffloadStats.gather(self.blocks, self.rest, self.store, self.optimizers, self.training.optimizer_seconds)

    @property
    def optimizers(self) -> list[OffloadedOptimizer]:
        """The optimizers in use (blocks, then the rest), e.g. to attach LR schedulers to each."""
        self._adopt_adapters()
        return self._optimizers.all()

    @internal_call
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()``, after the writes in flight.

        The blocks' parameters are read from storage one block at a time (copies, master dtype);
        ``module.state_dict()`` itself does the same.

        Returns:
            The module's state dict.
        """
        self._check_open()
        self.store.wait_writes()
        return self.module.state_dict()

    @internal_call
    def save(self, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 10**9) -> list[Path]:
        """Write the module's state as safetensors shards with an index (Hugging Face layout) into a folder.

        Written through the async-IO op, reading the blocks from storage one at a time (master values), so the model
        is never resident. Holds what ``state_dict()`` holds (parameters, persistent buffers) except that a tensor
        shared under several names is written once, under its first name (safetensors cannot store shared tensors;
        ``from_pretrained`` ties them again). A module with a Hugging Face ``config`` also gets its
        ``config.json``, so ``from_pretrained(path)`` loads the result (written aside and renamed over the old one, so
        a kill never leaves it half written).

        Args:
            path: The folder to write.
            max_shard_bytes: The most bytes of one shard.

        Returns:
            The shard paths.
        """
        self._check_open()
        self.training.finish_writes()
        self.store.wait_writes()
        shards = save_sharded(state_items(self.module, self.blocks, self.store), path, max_shard_bytes=max_shard_bytes)
        save_config(self.module, path)
        return shards

    @internal_call
    def scaled_loss_error(self, graph: LossGraph) -> BaseException | None:
        """The refusal of a ``GradScaler``'s scaled loss (``refusals.scaled_loss_error``), or None.

        Args:
            graph: The scaled loss's graph.

        Returns:
            The error, or None when a scaled loss is fine (closed, no block trained, or a loss not of this model).
        """
        if self._closed or self._optimizers.block is None:
            return None
        # every streamed block's Recompute takes the token: a loss reaching neither it nor a parameter of the model
        # is another model's
        if not graph.reaches([self._token, *self.module.parameters()]):
            return None
        return scaled_loss_error(self.mode, graph.scaler)

    def close(self, restore: bool = True) -> None:
        """End offloading: finish writes, unhook the blocks and remove the swap files and optimizer state files.

        Args:
            restore: True (the default): first read every block back into memory (master dtype), so the module
                holds its trained weights and works as before; this needs memory for the whole model (pinned blocks
                keep theirs, uncopied). If a block cannot be read, this raises and nothing is closed. False: discard
                them (take ``state_dict()`` first to keep them); calling a block then raises; blocks held in memory
                (pinned, or kept after a failed write) free theirs with the module.
        """
        if self._closed:
            return
        values = closing.read_back(self.blocks, self.store, self.training) if restore else None  # may raise: still open
        try:
            closing.put_back(self.blocks, self.store, self.training, values)
        finally:
            self._closed = True
            others: list[closing.Closable] = [*self.optimizers, self.experts]
            others += [self.data_parallel] if self.data_parallel is not None else []
            closing.detach(self.blocks, self.store, others, restore, self.patches)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this ParameterOffload is closed")

    def __enter__(self) -> "ParameterOffload":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
