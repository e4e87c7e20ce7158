"""Parameter offload: run and train models larger than memory by streaming blocks of parameters from storage.

``offload_parameters(module, ...)`` writes the parameters of chosen submodules ("blocks") to files and frees their
memory; each parameter keeps its identity but holds a 0-element placeholder of its dtype and device while it is on
storage (its shape lives in the swap record). A block's parameters are read back just before the block runs (the
next ``prefetch`` blocks are read meanwhile) and released right after.

Blocks (default rule): the children of every ``nn.ModuleList`` / ``nn.Sequential`` found by walking the module from
the top (the module itself included), not looking inside a block once chosen; children without parameters are
skipped. Blocks are expected to run in that order (prefetch follows it; another order is still correct, only slower).
Parameters outside blocks (embeddings, heads, norms) and all buffers stay in memory. A parameter may not be shared
between two blocks or between a block and the rest.

Inference (grad disabled, or nothing needs a gradient): the block's own ``forward`` runs on the resident parameters,
so outputs are bit-identical to the in-memory model.

Training uses recomputation (what ZeRO-Infinity does with activation checkpointing): each block runs inside a custom
autograd function that keeps only the block's inputs; backward reads the parameters again (prefetching earlier
blocks in reverse order), restores the RNG state, recomputes the block with gradients enabled and back-propagates
through it. The forward runs under the same grad mode as the in-memory model, so the same kernels are chosen and
results are bit-identical to in-memory training with the same optimizer (on deterministic kernels). Each block costs
one extra forward. Backward with ``retain_graph``/``create_graph`` through a block is not supported.

Gradients never pile up. Once a block's gradients are complete (after its last backward in the pass):
- ``mode="fused"`` (memory-minimal): the block's optimizer step runs right away inside backward, its optimizer state
  read from and written back to storage (``OffloadedOptimizer``), the updated weights are written back and the
  gradients freed. The block's state is read while its backward runs. One backward per step (no gradient
  accumulation) and no clipping by a global norm (``step(clip_grad_norm=...)`` raises ValueError): each block steps
  before the others' gradients exist. Per-parameter optimizers (Adam, AdamW, SGD, ...) give exactly the same result as
  a global step.
- ``mode="grads"``: the block's gradients go to storage (accumulating over several backward passes, in the master
  dtype); ``step()`` then streams block by block: weights and gradients in, optimizer step, weights out.
  ``step(clip_grad_norm=max_norm, norm_type=2.0)`` clips by the global norm in two passes: first the blocks'
  gradients are streamed in (``prefetch`` blocks ahead, pooled buffers) for their norms, which join those of the
  gradients outside blocks; then the step pass multiplies each gradient by ``min(max_norm / (norm + 1e-6), 1)``
  before stepping. Same arithmetic and order as ``torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm,
  norm_type)`` on the master-dtype gradients (``grad_norm``), so bit-identical; it returns the total norm. Cost:
  one more read of the gradients.
``step()`` also steps the parameters outside blocks (their state offloaded too); call it after each backward.

Mixed precision (``compute_dtype``): the stored parameters are the master weights (their dtype, e.g. fp32); blocks
compute with a copy cast to ``compute_dtype`` (e.g. bf16) whose gradients are cast back to the master dtype for the
step. Parameters report ``compute_dtype`` while offloaded; inputs of the blocks must match it (cast the rest of the
model, or use autocast).
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import get_device_states, set_device_states

from . import grad_norm
from .config import SwapConfig
from .optimizer import OffloadedOptimizer
from .pool import PAGE_SIZE, round_up
from .tensor_swapper import TENSOR_ALIGNMENT, SwapIn, SwapOut, TensorSwapper

MODES = ("fused", "grads")
OptimizerFactory = Callable[[list], torch.optim.Optimizer]


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


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _span(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of one group's file and staging buffer region holding ``tensors`` (as ``TensorSwapper`` packs them)."""
    return round_up(sum(round_up(t.numel() * t.element_size(), TENSOR_ALIGNMENT) for t in tensors))


def _placeholder(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(0, dtype=dtype or like.dtype, device=like.device)


class _Block:
    """One block's parameters and where they are: on storage, being read (``read``), resident (``materialized``),
    being written (``write``), or ``kept`` in memory after a failed write (then memory holds the only valid copy)."""

    def __init__(self, index: int, prefix: str, module: nn.Module, compute_dtype: torch.dtype | None):
        self.index, self.prefix, self.module = index, prefix, module
        self.group, self.grad_group = f"block{index}", f"grad{index}"
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        if compute_dtype is None:
            self.masters = list(self.params)
        else:
            self.masters = [nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in self.params]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.compute_dtype = compute_dtype
        self.nbytes = _nbytes(self.masters)
        self.compute_nbytes = 0 if compute_dtype is None else \
            sum(p.numel() for p in self.params) * torch.empty(0, dtype=compute_dtype).element_size()
        self.read: SwapIn | None = None
        self.materialized = False
        self.kept = False
        self.write: SwapOut | None = None
        self.written: dict[str, torch.Tensor] = {}
        self.pending_backward = 0
        self.grads: dict[str, torch.Tensor] = {}  # master-dtype gradients kept after their write failed

    def qualified(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def resident_bytes(self) -> int:
        held = self.read is not None or self.materialized or self.write is not None or self.kept
        return (self.nbytes if held else 0) + (self.compute_nbytes if self.materialized else 0)

    def set_data(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point the parameters at ``tensors`` (master values; compute copies are cast from them)."""
        for name, param, master in zip(self.names, self.params, self.masters):
            tensor = tensors[name]
            if master is param:
                param.data = tensor
            else:
                master.data = tensor
                param.data = tensor.to(self.compute_dtype)
        self.materialized = True

    def clear_data(self) -> None:
        for param, master in zip(self.params, self.masters):
            param.data = _placeholder(param, self.compute_dtype)
            if master is not param:
                master.data = _placeholder(master)
        self.materialized = False

    def master_tensors(self) -> dict[str, torch.Tensor]:
        return {name: master.detach() for name, master in zip(self.names, self.masters)}


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The default blocks of ``module`` as (qualified name, submodule): see the module docstring for the rule."""
    def walk(node: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
        found = []
        container = isinstance(node, (nn.ModuleList, nn.Sequential))
        for name, child in node.named_children():
            qualified = f"{prefix}{name}"
            if container and not isinstance(child, nn.ModuleList):
                if any(True for _ in child.parameters()):
                    found.append((qualified, child))
            else:
                found.extend(walk(child, qualified + "."))
        return found

    return walk(module, "")


class _BlockCall:
    """One call of a block: its non-tensor arguments, how to rebuild them, and its outputs' structure."""

    def __init__(self, offload: "ParameterOffload", block: _Block, forward: Callable, flat: list, spec: Any):
        self.offload, self.block, self.forward = offload, block, forward
        self.flat, self.spec = flat, spec
        self.positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        self.out_flat: list = []
        self.out_spec: Any = None
        self.out_positions: list[int] = []
        self.rng: tuple | None = None

    def run(self, tensors: Sequence[torch.Tensor]) -> Any:
        flat = list(self.flat)
        for position, tensor in zip(self.positions, tensors):
            flat[position] = tensor
        args, kwargs = pytree.tree_unflatten(flat, self.spec)
        return self.forward(*args, **kwargs)

    def rebuild(self, outputs: Sequence[torch.Tensor]) -> Any:
        flat = list(self.out_flat)
        for position, tensor in zip(self.out_positions, outputs):
            flat[position] = tensor
        return pytree.tree_unflatten(flat, self.out_spec)


def _detached(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().requires_grad_(t.requires_grad) for t in tensors]


def _device_type(tensors: Sequence[torch.Tensor]) -> str | None:
    """The inputs' accelerator type; None (torch then uses the current accelerator's) when all are on the CPU."""
    return next((t.device.type for t in tensors if t.device.type != "cpu"), None)


class _Recompute(torch.autograd.Function):
    """Runs a block keeping only its inputs; backward re-reads its parameters and recomputes it."""

    @staticmethod
    def forward(ctx, call: _BlockCall, token: torch.Tensor, *tensors: torch.Tensor):
        # token requires grad, so the outputs do even when no input does (the parameters are not inputs here)
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors)
        device_type = _device_type(tensors)
        call.rng = (torch.get_rng_state(), *get_device_states(*tensors), device_type)
        offload, block = call.offload, call.block
        offload._acquire(block, "forward", training=True)
        try:
            with torch.enable_grad():  # the same grad mode, hence the same kernels, as the in-memory model
                flat, call.out_spec = pytree.tree_flatten(call.run(_detached(tensors)))
            call.out_positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
            call.out_flat = [None if isinstance(x, torch.Tensor) else x for x in flat]
            outputs = tuple(flat[i].detach() for i in call.out_positions)
            del flat  # the graph (and its views of the parameters) goes before the parameters are released
        finally:
            offload._after_forward(block, training=True)
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        block.pending_backward += 1
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        call: _BlockCall = ctx.call
        offload, block = call.offload, call.block
        inputs = _detached(ctx.saved_tensors)
        offload._acquire(block, "backward", training=True)
        try:
            offload._prefetch_state(block)
            cpu_state, devices, states, device_type = call.rng
            with torch.random.fork_rng(devices=devices, device_type=device_type):
                torch.set_rng_state(cpu_state)
                set_device_states(devices, states, device_type=device_type)
                with torch.enable_grad():
                    flat, _ = pytree.tree_flatten(call.run(inputs))
            pairs = [(flat[i], g) for i, g in zip(call.out_positions, grads)
                     if g is not None and flat[i].requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            del flat, pairs
        except BaseException:
            offload._release(block)
            raise
        offload._after_backward(block)
        return (None, None, *[t.grad if t.requires_grad else None for t in inputs])


class ParameterOffload:
    """The handle ``offload_parameters`` returns: streams the blocks' parameters, steps them when training, and
    reports ``stats``. Use ``step()`` after each backward and ``zero_grad()`` as with an optimizer; ``close()``
    ends offloading (``restore=True`` reads the parameters back into memory first)."""

    def __init__(self, module: nn.Module, blocks: Sequence[tuple[str, nn.Module]], *, prefetch: int, mode: str,
                 optimizer: OptimizerFactory | None, compute_dtype: torch.dtype | None, config: SwapConfig):
        self.module = module
        self.prefetch = prefetch
        self.mode = mode
        self.compute_dtype = compute_dtype
        self.blocks = [_Block(i, prefix, block, compute_dtype) for i, (prefix, block) in enumerate(blocks)]
        self._check_sharing()
        block_bytes = max((_span(b.masters) for b in self.blocks), default=PAGE_SIZE)
        # the current block, the prefetch window and one write behind; anything more (gradients in grads mode) gets
        # short-lived one-off buffers, so idle pooled memory stays within the (prefetch + 2) blocks bound
        self.swapper = TensorSwapper(config.replace(chunk_bytes=block_bytes, buffer_count=prefetch + 2))
        in_blocks = {id(p) for b in self.blocks for p in b.params}
        self.rest = [p for p in module.parameters() if id(p) not in in_blocks]
        # a block's state (Adam: about two block spans, 3 chunks) read ahead during its backward, plus the chunks of
        # its step being written: 6 chunks of a block span; with more state per block, reads wait for those writes
        state_config = config.replace(chunk_bytes=block_bytes, buffer_count=6)
        self._block_optimizer = self._rest_optimizer = None
        if optimizer is not None:
            masters = [m for b in self.blocks for m in b.masters if m.requires_grad]
            self._block_optimizer = OffloadedOptimizer(optimizer, masters, state_config) if masters else None
            rest = [p for p in self.rest if p.requires_grad]
            self._rest_optimizer = OffloadedOptimizer(optimizer, rest, state_config) if rest else None
        self._token = torch.empty(0, requires_grad=True)
        self._grad_writes: list[tuple[_Block, SwapOut, dict]] = []
        self._io_wait = 0.0
        self._optimizer_seconds = 0.0
        self._peak = 0
        self._grad_bytes = 0
        self._peak_grad = 0
        self._closed = False
        self._offload_all()
        self._patched = []
        for block in self.blocks:
            self._patch(block)

    # -- setup ---------------------------------------------------------------------------------------------
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

    def _offload_all(self) -> None:
        """Write every block out (two writes in flight at most); release the parameters only once all are on
        storage, so a failure leaves the module exactly as it was."""
        writes: list[tuple[_Block, SwapOut]] = []
        try:
            for block in self.blocks:
                writes.append((block, self.swapper.swap_out({block.group: block.master_tensors()})))
                if len(writes) > 1:
                    self._wait_setup(*writes[-2])
            if writes:
                self._wait_setup(*writes[-1])
        except BaseException:
            try:
                self.swapper.close()
            except OSError:
                pass  # the first failure is the one reported
            raise
        for block in self.blocks:
            block.clear_data()

    def _wait_setup(self, block: _Block, write: SwapOut) -> None:
        try:
            write.wait()
        except OSError as e:
            raise OSError(e.errno, f"offloading the parameters of block {block.prefix} failed ({e.strerror}); the "
                                   f"module is unchanged", e.filename) from e

    def _patch(self, block: _Block) -> None:
        forward = block.module.forward

        def streamed_forward(*args, **kwargs):
            return self._run(block, forward, args, kwargs)

        block.module.forward = streamed_forward
        self._patched.append((block.module, streamed_forward))

    # -- running blocks --------------------------------------------------------------------------------------
    def _run(self, block: _Block, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if self._closed:
            raise RuntimeError(f"block {block.prefix}: its parameters were offloaded by a ParameterOffload closed "
                               f"without restore=True, so they are gone; close(restore=True) keeps them")
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        wants_grad = any(p.requires_grad for p in block.params)
        if not torch.is_grad_enabled() or not (wants_grad or any(t.requires_grad for t in tensors)):
            self._acquire(block, "forward", training=False)
            try:
                return forward(*args, **kwargs)
            finally:
                self._after_forward(block, training=False)
        if wants_grad and self._block_optimizer is None:
            raise ValueError(f"block {block.prefix} runs with gradients enabled but offload_parameters() got no "
                             f"optimizer=: pass optimizer= to train, freeze the parameters, or use torch.no_grad()")
        call = _BlockCall(self, block, forward, flat, spec)
        return call.rebuild(_Recompute.apply(call, self._token, *tensors))

    def _upcoming(self, index: int, phase: str, training: bool) -> list[int]:
        """The next ``prefetch`` distinct blocks expected after block ``index`` in ``phase``."""
        n = len(self.blocks)
        if phase == "forward":
            order = list(range(index + 1, n)) + (list(range(n - 1, -1, -1)) if training else list(range(n)))
        else:
            order = list(range(index - 1, -1, -1))
        window: list[int] = []
        for j in order:
            if len(window) == self.prefetch:
                break
            if j not in window:
                window.append(j)
        return window

    def _acquire(self, block: _Block, phase: str, training: bool) -> None:
        """Make ``block`` resident, start reading its window and release blocks outside it."""
        window = self._upcoming(block.index, phase, training)
        keep = {block.index, *window}
        for other in self.blocks:
            if other.index not in keep and (other.read is not None or other.materialized) and not other.kept:
                self._release(other)
        self._start_read(block)
        for j in window:
            self._start_read(self.blocks[j])
        self._materialize(block)

    def _after_forward(self, block: _Block, training: bool) -> None:
        if block.index not in self._upcoming(block.index, "forward", training):
            self._release(block)

    def _prefetch_state(self, block: _Block) -> None:
        """fused mode, the block's last backward of the pass: start reading its optimizer state, so the step
        that follows the backward finds it in memory."""
        if self.mode == "fused" and block.pending_backward == 1 and self._block_optimizer is not None:
            self._block_optimizer.prefetch(m for m in block.masters if m.requires_grad)

    def _after_backward(self, block: _Block) -> None:
        block.pending_backward -= 1
        if block.pending_backward > 0:
            self._release(block)
        elif self.mode == "fused":
            self._fused_step(block)
        else:
            self._write_grads(block)
            self._release(block)

    # -- reads and releases ------------------------------------------------------------------------------------
    def _start_read(self, block: _Block) -> None:
        if block.read is not None or block.materialized or block.kept:
            return
        self._wait_write(block)
        records = self.swapper.records(block.group)
        if len(records) != len(block.names):
            raise RuntimeError(f"block {block.prefix}: nothing valid on storage for its parameters "
                               f"{', '.join(block.qualified(n) for n in block.names[:3])}... (an earlier write "
                               f"failed and the copy in memory is gone)")
        try:
            block.read = self.swapper.swap_in([block.group])
        except OSError as e:
            raise self._read_error(block, e) from e
        self._note_peak()

    def _materialize(self, block: _Block) -> None:
        if block.materialized or block.kept:
            return
        start = time.perf_counter()
        try:
            tensors = block.read.wait()[block.group]
        except OSError as e:
            block.read = None
            raise self._read_error(block, e) from e
        finally:
            self._io_wait += time.perf_counter() - start
        block.set_data(tensors)
        self._note_peak()

    def _read_error(self, block: _Block, error: OSError) -> OSError:
        names = ", ".join(block.qualified(n) for n in block.names)
        path = error.filename or next(iter(self.swapper.records(block.group).values())).file
        if error.errno == errno.ENOENT:
            return FileNotFoundError(errno.ENOENT, f"the swap file of parameter {block.qualified(block.names[0])} "
                                                   f"(block {block.prefix}: {names}) is missing; it was deleted while "
                                                   f"offloaded, so these parameters are lost", path)
        return OSError(error.errno, f"reading parameters {names} (block {block.prefix}) failed: {error.strerror}",
                       path)

    def _release(self, block: _Block) -> None:
        if block.kept:
            return
        if block.materialized:
            block.clear_data()
        if block.read is not None:
            block.read.release()
            block.read = None

    # -- writes ------------------------------------------------------------------------------------------------
    def _start_write(self, block: _Block, staged: SwapIn | None) -> None:
        """Start writing the block's master values; its memory is released when the write succeeds."""
        tensors = block.master_tensors()
        block.write = self.swapper.swap_out({block.group: tensors}, staged=staged)
        block.written = tensors
        block.read = None
        if block.materialized or block.kept:  # the write holds the bytes now; the parameters let go
            block.clear_data()
        block.kept = False
        self._note_peak()

    def _wait_write(self, block: _Block) -> None:
        if block.write is None:
            return
        start = time.perf_counter()
        try:
            block.write.wait()
        except OSError as e:
            block.set_data(block.written)  # the bytes stay in memory, where they are the only valid copy
            block.kept = True
            raise OSError(e.errno, f"writing the parameters of block {block.prefix} failed ({e.strerror}); they "
                                   f"stay in memory; free space and call flush()", e.filename) from e
        finally:
            block.write, block.written = None, {}
            self._io_wait += time.perf_counter() - start
            self._note_peak()

    def _wait_param_writes(self) -> None:
        error = None
        for block in self.blocks:
            try:
                self._wait_write(block)
            except OSError as e:
                error = error or e
        if error is not None:
            raise error

    def _write_back(self, block: _Block) -> None:
        self._wait_param_writes()  # one block write in flight at most
        staged, block.read = block.read, None
        if block.kept and staged is None:
            self._start_write(block, staged=None)
            return
        try:
            self._start_write(block, staged=staged)
        except BaseException:
            block.kept = True  # the values stay where they are (the staging buffer left the pool)
            raise

    # -- steps -------------------------------------------------------------------------------------------------
    def _step_block(self, block: _Block, grads: dict[str, torch.Tensor]) -> None:
        """Step the block's resident masters with ``grads`` (master dtype) and start writing them back."""
        for name, master in zip(block.names, block.masters):
            master.grad = grads.get(name)
        start = time.perf_counter()
        try:
            self._block_optimizer.step()
        except BaseException:
            if block.read is not None:
                block.read.detach()  # the updated values stay in memory, the only valid copy
                block.read = None
            block.kept = True
            raise
        finally:
            self._optimizer_seconds += time.perf_counter() - start
            for param, master in zip(block.params, block.masters):
                master.grad = None
                param.grad = None
        self._write_back(block)

    def _block_grads(self, block: _Block, consume: bool = True) -> dict[str, torch.Tensor]:
        """The block's in-memory gradients in the master dtype (``param.grad`` added to any kept after a failed
        write; with ``consume`` the block holds none of those kept afterwards)."""
        grads = {name: (param.grad if param is master else param.grad.to(master.dtype))
                 for name, param, master in zip(block.names, block.params, block.masters) if param.grad is not None}
        kept = block.grads
        if consume:
            block.grads = {}
        for name, grad in kept.items():
            grads[name] = torch.add(grad, grads[name]) if name in grads else grad
        return grads

    def _fused_step(self, block: _Block) -> None:
        grads = self._block_grads(block)
        self._grad_bytes = _nbytes(grads.values())
        self._note_peak()
        self._step_block(block, grads)
        self._grad_bytes = 0

    def _write_grads(self, block: _Block) -> None:
        """Send the block's gradients to storage (added to those already there); ``param.grad`` is freed now and
        given back if the write fails."""
        grads = self._block_grads(block)
        self._grad_bytes = _nbytes(grads.values()) + sum(_nbytes(g.values()) for _, _, g in self._grad_writes)
        self._note_peak()
        self._wait_grad_writes()
        if not grads:
            return
        if self.swapper.records(block.grad_group):
            read = self.swapper.swap_in([block.grad_group])
            try:
                stored = self._timed_wait(read)[block.grad_group]
                grads = {name: torch.add(stored[name], grad) if name in stored else grad
                         for name, grad in grads.items()}
            finally:
                read.release()
        write = self.swapper.swap_out({block.grad_group: grads})
        self._grad_writes.append((block, write, grads))
        self._grad_bytes = _nbytes(grads.values())
        self._note_peak()
        for param in block.params:
            param.grad = None

    def _timed_wait(self, read: SwapIn) -> dict:
        start = time.perf_counter()
        try:
            return read.wait()
        finally:
            self._io_wait += time.perf_counter() - start

    def _wait_grad_writes(self) -> None:
        error = None
        while self._grad_writes:
            block, write, grads = self._grad_writes.pop(0)
            start = time.perf_counter()
            try:
                write.wait()
            except OSError as e:
                block.grads = grads  # the bytes on storage are unknown now: memory holds the only copy
                error = error or OSError(e.errno, f"writing the gradients of block {block.prefix} failed "
                                                  f"({e.strerror}); they stay in memory and step() uses them",
                                         e.filename)
            finally:
                self._io_wait += time.perf_counter() - start
        self._grad_bytes = sum(_nbytes(b.grads.values()) for b in self.blocks)
        if error is not None:
            raise error

    def _blocks_with_grads(self) -> list[_Block]:
        """grads mode: finish the gradient writes, release the blocks and list those holding gradients (on
        storage, or in memory after a failed write), in order."""
        self._wait_grad_writes()
        for block in self.blocks:
            self._release(block)
        return [b for b in self.blocks if self.swapper.records(b.grad_group) or b.grads
                or any(p.grad is not None for p in b.params)]

    def _stream_grads(self, todo: list[_Block], start_also: Callable[[_Block], None] | None = None,
                      prepare: Callable[[_Block], None] | None = None, discard: bool = False
                      ) -> Iterator[tuple[_Block, dict[str, torch.Tensor]]]:
        """Yield each block of ``todo`` with its gradients (master dtype), read from storage ``prefetch`` blocks
        ahead (pooled staging buffers, valid until the next block is asked for) or, after a failed write dropped
        the file, taken from memory. ``start_also(block)`` starts the block's other reads along with its
        gradients'; ``prepare(block)`` runs before its gradients are taken (a failure there loses none of those
        kept in memory); ``discard`` deletes each block's stored gradients once the caller is done with them."""
        reads: dict[int, SwapIn] = {}

        def start(k: int) -> None:
            if k < len(todo):
                block = todo[k]
                if start_also is not None:
                    start_also(block)
                if self.swapper.records(block.grad_group):
                    reads[block.index] = self.swapper.swap_in([block.grad_group])

        try:
            for k in range(self.prefetch + 1):
                start(k)
            for k, block in enumerate(todo):
                read = reads.pop(block.index, None)
                try:
                    if prepare is not None:
                        prepare(block)
                    grads = self._block_grads(block, consume=discard)
                    if read is not None:
                        grads = self._timed_wait(read)[block.grad_group]
                    yield block, grads
                finally:
                    if read is not None:
                        read.release()
                if discard:
                    self.swapper.discard(block.grad_group)
                start(k + 1 + self.prefetch)
        finally:
            for read in reads.values():
                read.release()

    def _global_norm(self, todo: list[_Block], norm_type: float) -> torch.Tensor:
        """grads mode: the norm of every gradient, the blocks' streamed from storage one window at a time, taken
        exactly as ``torch.nn.utils.clip_grad_norm_(module.parameters())`` takes it (see ``grad_norm``)."""
        norms: dict[int, torch.Tensor] = {}
        rest = [p for p in self.rest if p.grad is not None]
        norms.update(zip(map(id, rest), grad_norm.tensor_norms([p.grad for p in rest], norm_type)))
        for block, grads in self._stream_grads(todo):
            params = [p for name, p in zip(block.names, block.params) if name in grads]
            values = grad_norm.tensor_norms([grads[name] for name in block.names if name in grads], norm_type)
            norms.update(zip(map(id, params), values))
        ordered = [norms[id(p)] for p in self.module.parameters() if id(p) in norms]
        return grad_norm.total_norm(ordered, norm_type)

    def _step_streamed(self, todo: list[_Block], coefficient: torch.Tensor | None) -> None:
        """grads mode: weights and gradients in, (clip), step, weights out, block by block (``prefetch`` ahead)."""
        def start_also(block: _Block) -> None:
            self._start_read(block)
            self._block_optimizer.prefetch(m for m in block.masters if m.requires_grad)

        for block, grads in self._stream_grads(todo, start_also, prepare=self._materialize, discard=True):
            if coefficient is not None:
                grad_norm.scale_([grads[name] for name in block.names if name in grads], coefficient)
            self._step_block(block, grads)

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
        total = coefficient = None
        if clip_grad_norm is not None:
            grad_norm.check_clip_args(clip_grad_norm, norm_type)
            if self.mode == "fused":
                raise ValueError("step(clip_grad_norm=...): clipping by the global gradient norm is impossible in "
                                 "fused mode (each block already stepped inside backward, before the other blocks' "
                                 "gradients existed); use offload_parameters(..., mode=\"grads\") to clip")
            total = self._global_norm(self._blocks_with_grads(), norm_type)
            coefficient = grad_norm.clip_coefficient(clip_grad_norm, total)
        if self.mode == "grads" and self._block_optimizer is not None:
            self._step_streamed(self._blocks_with_grads(), coefficient)
        self._wait_param_writes()
        if self._rest_optimizer is not None:
            if coefficient is not None:
                grad_norm.scale_([p.grad for p in self.rest if p.grad is not None], coefficient)
            self._rest_optimizer.step()
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: those outside blocks, and the blocks' gradients on storage (grads mode)."""
        self._check_open()
        self._wait_grad_writes()
        if self._rest_optimizer is not None:
            self._rest_optimizer.zero_grad(set_to_none)
        for block in self.blocks:
            self.swapper.discard(block.grad_group)
            block.grads = {}
            for param in block.params:
                param.grad = None

    def flush(self) -> None:
        """Wait for every write in flight and write out blocks kept in memory after a failed write; raise the
        first failure (those blocks stay in memory)."""
        self._check_open()
        error = None
        for action in (self._wait_grad_writes, self._wait_param_writes):
            try:
                action()
            except OSError as e:
                error = error or e
        for block in self.blocks:
            if block.kept:
                try:
                    self._start_write(block, staged=None)
                    self._wait_write(block)
                except OSError as e:
                    error = error or e
        if error is not None:
            raise error

    # -- figures, checkpoints, lifetime --------------------------------------------------------------------------
    def _note_peak(self) -> None:
        self._peak = max(self._peak, sum(b.resident_bytes() for b in self.blocks))
        self._peak_grad = max(self._peak_grad, self._grad_bytes)

    def reset_peak(self) -> None:
        """Start measuring ``peak_bytes`` and ``peak_grad_bytes`` afresh from what is resident now."""
        self._peak = sum(b.resident_bytes() for b in self.blocks)
        self._peak_grad = self._grad_bytes

    @property
    def stats(self) -> OffloadStats:
        state_read = state_written = 0
        for optimizer in (self._block_optimizer, self._rest_optimizer):
            if optimizer is not None:
                state_read += optimizer.swapper.bytes_read
                state_written += optimizer.swapper.bytes_written
        return OffloadStats(
            bytes_read=self.swapper.bytes_read, bytes_written=self.swapper.bytes_written,
            state_bytes_read=state_read, state_bytes_written=state_written,
            io_wait_seconds=self._io_wait, optimizer_seconds=self._optimizer_seconds,
            resident_bytes=sum(b.resident_bytes() for b in self.blocks), peak_bytes=self._peak,
            grad_bytes=self._grad_bytes, peak_grad_bytes=self._peak_grad,
            block_bytes=max((b.nbytes + b.compute_nbytes for b in self.blocks), default=0),
            rest_bytes=_nbytes(self.rest),
            staging_bytes=self.swapper.pool.held_bytes() + sum(o.swapper.pool.held_bytes() for o in self.optimizers))

    @property
    def optimizers(self) -> list[OffloadedOptimizer]:
        """The optimizers in use (blocks, then the rest), e.g. to attach LR schedulers to each."""
        return [o for o in (self._block_optimizer, self._rest_optimizer) if o is not None]

    def _read_block(self, block: _Block) -> dict[str, torch.Tensor]:
        """Copies of the block's master values (from memory when resident or kept)."""
        if block.materialized or block.kept:
            return {name: t.clone() for name, t in block.master_tensors().items()}
        self._start_read(block)
        try:
            self._materialize(block)
            return {name: t.clone() for name, t in block.master_tensors().items()}
        finally:
            self._release(block)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()`` with the blocks' parameters read from storage (copies, master dtype)."""
        self._check_open()
        self._wait_param_writes()
        result = self.module.state_dict()
        for block in self.blocks:
            for name, tensor in self._read_block(block).items():
                result[block.qualified(name)] = tensor
        return result

    def close(self, restore: bool = False) -> None:
        """End offloading: finish writes, unhook the blocks and remove the swap files. ``restore=True`` first reads
        every parameter back into memory (master dtype), so the module works as before; otherwise offloaded
        parameters stay empty placeholders and calling a block raises."""
        if self._closed:
            return
        try:
            self._wait_grad_writes()
            self._wait_param_writes()
            if restore:
                values = [self._read_block(block) for block in self.blocks]
                for block, tensors in zip(self.blocks, values):
                    block.kept = False
                    self._release(block)
                    for name, param in zip(block.names, block.params):
                        param.data = tensors[name]
            else:
                for block in self.blocks:
                    self._release(block)
        finally:
            self._closed = True
            for module, forward in self._patched if restore else ():  # else calls keep failing with a clear error
                if module.__dict__.get("forward") is forward:
                    del module.forward
            self.swapper.close()
            for optimizer in self.optimizers:
                optimizer.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this ParameterOffload is closed")

    def __enter__(self) -> "ParameterOffload":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def offload_parameters(module: nn.Module, path: str | None = None, *, blocks: Sequence[nn.Module] | None = None,
                       prefetch: int = 1, mode: str = "fused", optimizer: OptimizerFactory | None = None,
                       compute_dtype: torch.dtype | None = None, config: SwapConfig | None = None
                       ) -> ParameterOffload:
    """Move the parameters of ``module``'s blocks to storage and stream them in as the blocks run.

    path: the folder for swap files (default: ``config.folder``, else the temp folder); each run gets its own
        sub-folder, removed on ``close()``.
    blocks: the submodules to stream (default: see ``find_blocks``), in the order they run.
    prefetch: how many blocks ahead are read while one computes (0: read each block when it starts).
    mode: "fused" (optimizer step inside backward, memory-minimal) or "grads" (gradients to storage, ``step()``
        streams); see the module docstring.
    optimizer: to train, a factory called with a list of parameters that returns a ``torch.optim.Optimizer``
        (e.g. ``lambda ps: torch.optim.AdamW(ps, lr=1e-4)``); called once for the blocks' master weights and once
        for the parameters outside blocks; their state is offloaded too. None: inference only.
    compute_dtype: blocks compute in this dtype while their stored (master) weights keep theirs.
    config: a ``SwapConfig`` (async-IO settings, pinning, checksums); buffer sizes are chosen here.
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
    config = config or SwapConfig()
    if path is not None:
        config = config.replace(folder=path)
    return ParameterOffload(module, chosen, prefetch=prefetch, mode=mode, optimizer=optimizer,
                            compute_dtype=compute_dtype, config=config)
