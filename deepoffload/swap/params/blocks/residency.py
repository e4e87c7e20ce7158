"""Where one block's parameters are: an explicit state with checked transitions.

::

    ON_STORAGE --start_read--> READING --materialize--> RESIDENT --release--> ON_STORAGE
        ^                        |  (read failed / released)   |
        |                        +--------> ON_STORAGE          +--step failed--> KEPT
        |                                                       +--pin--> PINNED   |
        |                                                       |           |      |
        +--write done-- WRITING <--------start_write------------+-----------+------+
                           |                                          (unpin)
                           +--write failed--> KEPT (memory holds the only valid copy)

A PINNED block (within ``max_resident_bytes``) stays in memory, outside the staging pool, and steps there: from its
first step on, storage holds stale values, so it leaves memory only through a write (unpinning) or into RESTORED;
straight to ON_STORAGE only when its ``ByteSource`` is read-only (a checkpoint: never stepped or changed).
``close(restore=True)`` ends every block in RESTORED. Releasing a RESIDENT block that user code changed in place
(``Block.changed``) starts its write instead of dropping the change. A move not in ``TRANSITIONS`` raises
``ResidencyError`` at once, so a bookkeeping bug stops the program instead of computing with a placeholder or
overwriting the only valid copy of a block.
"""

from __future__ import annotations

import enum
import weakref
from typing import Callable, Iterable

import torch
from torch import nn

from ....errors import ResidencyError
from ...pool import round_up
from ...tensor_swapper import TENSOR_ALIGNMENT, SwapIn, SwapOut
from ..storage.sources import ByteSource, SwapFiles
from .adapters import streamed_parameters
from .placeholders import plain, refuse_grad, streamed


class Residency(enum.Enum):
    """Where a block's parameters are (see the module docstring for the transitions).

    Attributes:
        ON_STORAGE: Storage holds the values; the parameters are 0-element placeholders.
        READING: A read into a staging buffer is in flight.
        RESIDENT: The parameters point into the staging buffer of a completed read (storage agrees).
        WRITING: A write of the values is in flight; the write holds the memory until it completes.
        KEPT: Resident and the only valid copy (a write or step failed): never released until written.
        PINNED: Kept resident by the budget, in its own memory; the valid copy (storage is stale once stepped).
        RESTORED: Offloading ended: the parameters hold their values in memory for good.
    """

    ON_STORAGE = "on storage"  # storage holds the values; the parameters are 0-element placeholders
    READING = "reading"  # a read into a staging buffer is in flight
    RESIDENT = "resident"  # the parameters point into the staging buffer of a completed read (storage agrees)
    WRITING = "writing"  # a write of the values is in flight; the write holds the memory until it completes
    KEPT = "kept"  # resident and the only valid copy (a write or step failed): never released until written
    PINNED = "pinned"  # kept resident by the budget, its own memory; the valid copy (storage is stale once stepped)
    RESTORED = "restored"  # offloading ended: the parameters hold their values in memory for good


TRANSITIONS: dict[Residency, frozenset[Residency]] = {
    Residency.ON_STORAGE: frozenset({Residency.READING, Residency.RESTORED}),
    Residency.READING: frozenset({Residency.RESIDENT, Residency.ON_STORAGE}),
    Residency.RESIDENT: frozenset(
        {Residency.ON_STORAGE, Residency.WRITING, Residency.KEPT, Residency.RESTORED, Residency.PINNED}
    ),
    Residency.WRITING: frozenset({Residency.ON_STORAGE, Residency.KEPT}),
    Residency.KEPT: frozenset({Residency.WRITING, Residency.RESTORED}),
    Residency.PINNED: frozenset({Residency.WRITING, Residency.RESTORED, Residency.ON_STORAGE}),
    Residency.RESTORED: frozenset(),
}


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of ``tensors``' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def span(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of one group's file and staging buffer region holding ``tensors`` (as ``TensorSwapper`` packs them)."""
    return round_up(sum(round_up(t.numel() * t.element_size(), TENSOR_ALIGNMENT) for t in tensors))


def dense_layout(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of ``tensor`` when they lay it out densely but not in row-major order, else None.

    Dense: every element at its own offset, no gaps (``channels_last``, a transpose). Row-major tensors need nothing
    kept; overlapping or gapped layouts (an ``expand``, a slice) are not given back: such values are read row-major.

    Args:
        tensor: A parameter's values.

    Returns:
        Its strides, or None when row-major or not dense.
    """
    if tensor.is_contiguous():
        return None
    dims = sorted((stride, size) for stride, size in zip(tensor.stride(), tensor.shape) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return tuple(tensor.stride())


def placeholder(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A 0-element tensor on ``like``'s device, of ``dtype`` (default: ``like``'s)."""
    return torch.empty(0, dtype=dtype or like.dtype, device=like.device)


def own_dtype_parameters(module: nn.Module, compute_dtype: torch.dtype | None) -> set[int]:
    """ids of the parameters that keep their own dtype under ``compute_dtype``.

    Those are the parameters of submodules holding floating-point buffers of another dtype (BatchNorm running
    statistics), which compute in mixed precision (inputs in ``compute_dtype``, statistics and affine parameters in
    theirs), as ``torch.autocast`` runs them.

    Args:
        module: The block.
        compute_dtype: The dtype the block computes in (None: its own).

    Returns:
        The ids (empty without ``compute_dtype``).
    """
    if compute_dtype is None:
        return set()
    own: set[int] = set()
    for sub in module.modules():
        if any(b.is_floating_point() and b.dtype != compute_dtype for b in sub.buffers(recurse=False)):
            own.update(id(p) for p in sub.parameters(recurse=False))
    return own


class Block:
    """One block's parameters, their residency and the IO that holds their memory.

    The IO is ``read`` while READING or RESIDENT, ``write`` while WRITING.

    Args:
        index: The block's position in the order blocks run.
        prefix: Its qualified name in the model ("" for the model itself).
        module: The block.
        compute_dtype: The dtype it computes in (None: its own); parameters of another dtype get compute copies.
        layout_of: A parameter's strides when dense but not row-major, else None (``dense_layout``; for a
            placeholder of a meta parameter, the meta one's: ``Materializer.layout_of``).
    """

    def __init__(
        self,
        index: int,
        prefix: str,
        module: nn.Module,
        compute_dtype: torch.dtype | None,
        layout_of: Callable[[torch.Tensor], tuple[int, ...] | None] = dense_layout,
    ):
        self.index, self.prefix, self.module = index, prefix, module
        self.group, self.grad_group = f"block{index}", f"grad{index}"
        named = streamed_parameters(module)  # what the block is made of, as its adapter says
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        own = own_dtype_parameters(module, compute_dtype)
        # a parameter computing in another dtype than its master's gets a compute copy; the others are their master
        self.masters = [
            p if compute_dtype is None or id(p) in own else nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            for p in self.params
        ]
        self.shapes = [tuple(p.shape) for p in self.params]
        # storage holds the values in row-major order; a parameter laid out otherwise (channels_last, a transposed
        # weight) gets its layout back when read, since kernels (a convolution's) choose by it and round differently
        self.layouts = [layout_of(p) for p in self.params]
        self.compute_dtype = compute_dtype
        self.nbytes = nbytes(self.masters)
        # read values copied into their own layout (``set_data``): memory outside the staging pool while in memory
        self.layout_nbytes = nbytes(m for m, layout in zip(self.masters, self.layouts) if layout is not None)
        # what the block holds in memory beyond its stored values: compute copies and the layout copies
        self.compute_nbytes = self.layout_nbytes + sum(
            p.numel() * torch.empty(0, dtype=compute_dtype).element_size()
            for p, m in zip(self.params, self.masters)
            if m is not p
        )
        self.state = Residency.RESIDENT  # until offload_parameters has written it (see ``written_out``)
        self.read: SwapIn | None = None
        self.write: SwapOut | None = None
        self.written: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}  # master-dtype gradients kept after their write failed
        self.partial: dict[str, torch.Tensor] = {}  # ``param.grad`` of a pass's earlier backwards, while released
        self.calls: weakref.WeakSet = weakref.WeakSet()  # training calls whose backward has not run yet
        self.steps = 0  # optimizer steps of this block so far
        self.stepped = False  # fused mode: stepped since the last ``ParameterOffload.step()``
        self.deferred = False  # fused mode: its gradients (``partial``) wait for ``ParameterOffload.step()``
        self.grads_stored = False  # grads mode: its gradients are on storage, waiting for ``step()``
        self.exporting = 0  # inside ``module.state_dict()`` of the block (its hooks put the real weights in)
        self.discarded = False  # ``close(restore=False)`` dropped its values
        self.source: ByteSource = SwapFiles()  # where its stored values live (a checkpoint serves them read-only)
        self.grads_read_as_none = False  # ``.grad`` reads None while ``grads_away()`` (a Trainer's logged norm)
        self.seen: list[tuple] = []  # per parameter: version counter, data pointer, dtype, device when in memory
        self.skip: frozenset[str] = frozenset()  # parameters an inference read leaves out (experts read on demand)
        self.read_partly = False  # read without ``skip``: those parameters still hold placeholders
        self.record_versions()

    @property
    def served(self) -> str | None:
        """The checkpoint file the block's values are served from read-only, or None (its source is writable)."""
        return None if self.source.writable else self.source.where

    @property
    def trainable(self) -> bool:
        """Whether any parameter requires a gradient now (``requires_grad_`` may change it after offloading)."""
        return any(p.requires_grad for p in self.params)

    def names_now(self) -> dict[str, str]:
        """Each streamed parameter's name in the block now, by its name at offloading.

        The same unless an adapter layer wrapped its module since (``q_proj.weight`` -> ``q_proj.base_layer.weight``).

        Returns:
            ``{name at offloading: name now}``.
        """
        now = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=False)}
        return {name: now.get(id(param), name) for name, param in zip(self.names, self.params)}

    def qualified(self, name: str) -> str:
        """The model's name of the block's parameter ``name``."""
        return f"{self.prefix}.{name}" if self.prefix else name

    # -- state ------------------------------------------------------------------------------------------------
    def move(self, to: Residency) -> None:
        """Change the block's state to ``to``.

        Args:
            to: The new state.

        Raises:
            ResidencyError: When ``TRANSITIONS`` has no such move (a bookkeeping bug).
        """
        if to not in TRANSITIONS[self.state]:
            raise ResidencyError(
                f"block {self.prefix}: its parameters cannot go from {self.state.value} to "
                f"{to.value} (a bookkeeping bug in deepoffload; please report it)"
            )
        self.state = to

    @property
    def in_memory(self) -> bool:
        """The parameters hold real values (RESIDENT, KEPT or PINNED)."""
        return self.state in (Residency.RESIDENT, Residency.KEPT, Residency.PINNED)

    def grads_away(self) -> str | None:
        """Where the block's gradients are when not on its parameters' ``.grad`` until ``step()``.

        Returns:
            The place, in words, or None when ``.grad`` tells the truth.
        """
        if self.stepped:
            return "already applied by the block's optimizer step inside backward (fused mode)"
        if self.grads_stored or self.grads or self.partial:
            return "kept by deepoffload (on storage or in its own memory) for the step"
        return None

    def guard_grads(self) -> None:
        """While the block is in memory and its gradients are away, make ``p.grad`` refuse to read None.

        See ``GradsAwayParameter``; the parameters are plain otherwise.
        """
        away = self.in_memory and self.grads_away() is not None
        for name, param in zip(self.names, self.params):
            if away:
                refuse_grad(param, self, name)
            elif type(param) is not nn.Parameter and self.in_memory:
                plain(param)

    def unguard_grads(self) -> None:
        """Plain parameters for computing (a block in memory) or for good (offloading ended)."""
        if self.in_memory or self.state is Residency.RESTORED:
            for param in self.params:
                plain(param)

    def resident_bytes(self) -> int:
        """The block's parameter bytes in memory now: stored values (unless on storage) and compute copies."""
        held = self.state is not Residency.ON_STORAGE
        return (self.nbytes if held else 0) + (self.compute_nbytes if self.in_memory else 0)

    # -- values -----------------------------------------------------------------------------------------------
    def set_data(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point the parameters at ``tensors`` (master values; compute copies are cast from them)."""
        for name, param, master, layout in zip(self.names, self.params, self.masters, self.layouts):
            if name not in tensors and name in self.skip:  # (a partial read: it stays a placeholder)
                continue
            tensor = tensors[name]
            if layout is not None and tensor.stride() != layout:  # a copy outside the pool, in the layout it had
                strided = torch.empty_strided(tensor.shape, layout, dtype=tensor.dtype, device=tensor.device)
                tensor = strided.copy_(tensor)
            plain(param)
            if master is param:
                param.data = tensor
            else:
                master.data = tensor
                param.data = tensor.to(self.compute_dtype)
        self.record_versions()

    def refresh_compute(self) -> None:
        """Cast the compute copies again from the masters (after the masters stepped in memory).

        ``set_data`` casts them so after a read.
        """
        for param, master in zip(self.params, self.masters):
            if master is not param:
                param.data = master.detach().to(self.compute_dtype)
        self.record_versions()

    def record_versions(self) -> None:
        """Note each parameter's version counter and storage, so ``changed`` finds what user code changed since.

        Seen are in-place ops on the parameter (``p.mul_()``, ``nn.init``, ``load_state_dict``) and
        ``p.data = ...``. Writes through ``p.data`` (``p.data.copy_()``) bump another version counter and are not seen.
        """
        self.seen = [(p._version, p.data_ptr(), p.dtype, p.device) for p in self.params]

    def changed(self) -> list[str]:
        """Names of the parameters changed since ``record_versions``."""
        return [
            name
            for name, p, seen in zip(self.names, self.params, self.seen)
            if (p._version, p.data_ptr(), p.dtype, p.device) != seen
        ]

    def unwritable(self, names: list[str]) -> dict[str, str]:
        """Of the changed ``names``, those whose values cannot be written to storage exactly, with the reason."""
        read_only = self.source.read_only()
        if read_only is not None:
            return {name: f"its block is {read_only}" for name in names}
        if self.read_partly:  # (writing it back would write experts never read)
            why = "its block was read without its experts (an inference forward reads the chosen experts alone)"
            return dict.fromkeys(names, f"{why}; change it with gradients enabled, where the block is read whole")
        reasons = {}
        for name in names:
            k = self.names.index(name)
            param, master, (_, _, dtype, device) = self.params[k], self.masters[k], self.seen[k]
            if master is not param:
                reasons[name] = (
                    f"it is a {self.compute_dtype} compute copy of {master.dtype} master values "
                    f"(compute_dtype=), and the masters are what is stored"
                )
            elif tuple(param.shape) != self.shapes[k] or param.dtype != dtype or param.device != device:
                reasons[name] = (
                    f"it is now {tuple(param.shape)} {param.dtype} on {param.device}, but stored as "
                    f"{self.shapes[k]} {dtype} on {device}"
                )
        return reasons

    def clear_data(self) -> None:
        """Point the parameters at placeholders; they are ``StreamedParameter`` until ``set_data``."""
        for name, param, master in zip(self.names, self.params, self.masters):
            param.data = placeholder(param, None if master is param else self.compute_dtype)
            if master is not param:
                master.data = placeholder(master)
            streamed(param, self, name)

    def stash_grads(self) -> None:
        """Take ``param.grad`` off the parameters before they are released.

        An optimizer must not see gradients of a block whose values are not in memory; ``restore_grads`` puts them
        back for its next backward, where autograd adds to them exactly as in memory
        (``tests/swap/params/test_params_training.py::test_gradient_accumulation_in_grads_mode``).
        """
        for name, param in zip(self.names, self.params):
            if param.grad is not None:
                self.partial[name] = param.grad
                param.grad = None

    def restore_grads(self) -> None:
        """Put the gradients ``stash_grads`` took back on the parameters."""
        for name, param in zip(self.names, self.params):
            if name in self.partial:
                param.grad = self.partial.pop(name)

    def master_tensors(self) -> dict[str, torch.Tensor]:
        """The master values by name (detached, not copied)."""
        return {name: master.detach() for name, master in zip(self.names, self.masters)}
