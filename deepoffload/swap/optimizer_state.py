"""An optimizer's per-parameter state on storage.

Which tensors go there, who owns them while they are there, and moving a chunk's state between the optimizer and
the swapper.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

from .tensor_swapper import SwapIn, SwapOut, TensorSwapper

if TYPE_CHECKING:
    from typing_extensions import TypeGuard  # (typing has it from Python 3.10)

    from .chunks import Chunk


def storable(value: Any) -> bool:
    """Whether ``value`` can go to storage.

    Returns:
        True for a tensor with one byte buffer (strided, not quantized, not on ``meta``); others (e.g. SGD's sparse
        momentum for sparse gradients) stay in memory.
    """
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and not value.is_quantized
        and not value.is_meta
    )


class StoredState(dict):
    """A parameter's entry in the wrapped optimizer's ``state`` while its tensors are on storage.

    It holds the non-tensor values. The stored tensors belong to this entry: once it is replaced or removed
    (``opt.state[p] = {}``, ``del opt.state[p]``, ``opt.state.clear()``, a new ``opt.state``) or cleared, they are
    dropped, so the optimizer starts that state afresh, as it would in memory.
    """

    cleared = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offloaded: set = set()  # keys whose tensors went to storage (absent from memory between steps)

    def clear(self) -> None:
        """Empty the entry; its stored tensors go with it."""
        self.cleared = True
        super().clear()

    def __missing__(self, key: Any) -> Any:
        if key in self.offloaded and not self.cleared:
            raise KeyError(
                f"{key!r}: this tensor of the parameter's optimizer state is on storage between steps "
                f"(an OffloadedOptimizer keeps only non-tensor state in memory); read it from "
                f"opt.state_dict() (copies of all the state)"
            )
        raise KeyError(key)


def _references(values: dict, key: Any) -> int:
    return sys.getrefcount(values[key])


_ALONE = _references({"t": torch.empty(0)}, "t")  # the count for a tensor its state entry alone refers to


def _shares_memory(values: dict, key: Any, bases: set[int]) -> bool:
    """Whether the state tensor ``values[key]`` is reached other than through its entry.

    That is referred to from elsewhere (another parameter's state, the optimizer, the caller), or a view of another
    tensor of the entry or viewed by one (``bases``: ids of the entry's tensors' bases). A copy on storage would stop
    sharing its memory, so it stays in memory.

    Returns:
        True when it shares its memory.
    """
    value = values[key]
    base = value._base
    return (
        (base is not None and any(other is base for other in values.values()))
        or id(value) in bases
        or _references(values, key) > _ALONE + 1
    )  # (+1: ``value`` here)


def holds_stored(values: Any) -> TypeGuard[StoredState]:
    """Whether a parameter's state entry still owns the tensors stored for it (see ``StoredState``)."""
    return type(values) is StoredState and not values.cleared


def state_bytes(tensor: torch.Tensor) -> int:
    """Bytes a state tensor stores (a DTensor's local shard).

    Args:
        tensor: The tensor.

    Returns:
        Its bytes.
    """
    local = tensor.to_local() if hasattr(tensor, "to_local") and hasattr(tensor, "placements") else tensor
    return local.numel() * local.element_size()


def restore(optimizer: torch.optim.Optimizer, chunk: Chunk, read: SwapIn) -> None:
    """Put a chunk's state, read from storage, into the wrapped optimizer's state."""
    state, by_name = optimizer.state, chunk.by_name
    for name, tensors in read.wait().items():
        values = state.get(by_name[name])
        if not holds_stored(values):
            continue  # the user reset this state since it was stored: the optimizer starts it afresh
        if values:  # a tensor the user put there since wins over the stored one, as it would in memory
            for key, tensor in tensors.items():
                values.setdefault(key, tensor)
        else:
            values.update(tensors)


def write_back(
    optimizer: torch.optim.Optimizer, swapper: TensorSwapper, chunk: Chunk, staged: SwapIn
) -> SwapOut | None:
    """Store a chunk's state the cheap way, writing the read's buffer back as it is, when that is possible.

    That is the common case: every parameter's state holds exactly the tensors read (stepped in place, none added,
    replaced or removed). The tensors are dropped from memory once written.

    Args:
        optimizer: The wrapped optimizer.
        swapper: The optimizer's swapper.
        chunk: The chunk just stepped.
        staged: The read of the chunk's state.

    Returns:
        The write in flight, or None when the state changed otherwise (nothing done).
    """
    read = staged.wait()
    if len(read) != len(chunk):
        return None
    state = optimizer.state
    pairs: list[tuple[StoredState, dict[str, torch.Tensor]]] = []
    for param, name in zip(chunk, chunk.names):
        values, views = state.get(param), read.get(name)
        if not holds_stored(values) or views is None or len(values) != len(views):
            return None
        for key, view in views.items():
            if values.get(key) is not view:
                return None
        pairs.append((values, views))

    def drop() -> None:  # the bytes are safe on storage: release the memory
        for values, views in pairs:
            for key, view in views.items():
                if values.get(key) is view:
                    del values[key]
                    values.offloaded.add(key)

    return swapper.write_back(staged, on_done=drop)


def write_copy(
    optimizer: torch.optim.Optimizer,
    swapper: TensorSwapper,
    chunk: Chunk,
    staged: SwapIn,
    names: dict[int, str],
    loading: bool,
    strides: dict[str, dict[str, tuple[int, ...]]],
) -> SwapOut:
    """Store a chunk's state as it is after its step (tensors added, replaced or removed).

    Args:
        optimizer: The wrapped optimizer.
        swapper: The optimizer's swapper.
        chunk: The chunk just stepped.
        staged: The read of the chunk's state.
        names: id(param) -> its name in ``swapper``.
        loading: The state was just loaded (its tensors may still be the caller's).
        strides: name in ``swapper`` -> key -> the strides its tensor had in memory where they were not
            contiguous (``channels_last``, transposed; the bytes are stored in contiguous order): updated here.

    Returns:
        The write in flight.
    """
    state = optimizer.state
    written = {}
    read = staged.wait()
    for p, name in zip(chunk, chunk.names):
        values = state.get(p)
        if not values:
            continue  # nothing to store: it leaves nothing behind on storage (below)
        tensors = {k: v for k, v in values.items() if storable(v)}
        if tensors and not loading:  # (a loaded state's tensors may still be the caller's: copied)
            views = read.get(name, {})
            bases = {id(v._base) for v in tensors.values() if v._base is not None}
            del tensors
            tensors = {
                k: values[k]
                for k in list(values)
                if storable(values[k]) and (values[k] is views.get(k) or not _shares_memory(values, k, bases))
            }
        if tensors:
            written[p] = tensors
            if not holds_stored(values):
                state[p] = StoredState(values)

    def drop() -> None:  # the bytes are safe on storage: release the memory
        for param, tensors in written.items():
            state = optimizer.state[param]
            for key, tensor in tensors.items():
                if state.get(key) is tensor:
                    del state[key]
                    if type(state) is StoredState:
                        state.offloaded.add(key)

    for param, tensors in written.items():
        _note_strides(tensors, read.get(names[id(param)], {}), strides.setdefault(names[id(param)], {}))
    if len(written) < len(chunk):
        for param, name in zip(chunk, chunk.names):  # state that disappeared (or was never there) leaves
            if param not in written:  # nothing behind on storage
                swapper.discard(name)
                strides.pop(name, None)
    write = swapper.swap_out({names[id(p)]: t for p, t in written.items()}, on_done=drop, staged=staged)
    # The staging buffer now holds the bytes: the state's own tensors (e.g. made in ordinary memory by the
    # first step) are freed now, not when the write is done; the state holds views of the buffer meanwhile.
    for name, views in write.staged().items():
        param = chunk.by_name[name]
        values, tensors = state[param], written[param]
        for key, view in views.items():
            if values.get(key) is tensors[key]:
                values[key] = tensors[key] = view
    return write


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill its memory exactly once in some order of its dimensions (a permutation)."""
    if not tensor.numel():
        return False
    expected = 1
    for dim in sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), tensor.shape[d])):
        if tensor.shape[dim] == 1:
            continue
        if tensor.stride(dim) != expected:
            return False
        expected *= tensor.shape[dim]
    return True


def _note_strides(
    tensors: dict[str, torch.Tensor], views: dict[str, torch.Tensor], kept: dict[str, tuple[int, ...]]
) -> None:
    """Remember the strides of the tensors about to be stored that are dense but not contiguous.

    A tensor that is the staging buffer's own view (read back contiguous) leaves what was remembered for it.
    """
    for key, tensor in tensors.items():
        if tensor is views.get(key):
            continue
        if type(tensor) is torch.Tensor and not tensor.is_contiguous() and _dense(tensor):
            kept[key] = tuple(tensor.stride())
        else:
            kept.pop(key, None)


def _given_back(value: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """A copy of a stored tensor for the caller, with the strides it had in memory (``stride``, or contiguous)."""
    if stride is None or type(value) is not torch.Tensor:
        return value.clone()
    out = torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device)
    return out.copy_(value)


def read_stored(
    chunks: list[Chunk],
    read: Callable[[Chunk], SwapIn],
    index: dict[int, int],
    state: dict[int, dict[str, Any]],
    strides: dict[str, dict[str, tuple[int, ...]]],
) -> None:
    """Copy the stored state of ``chunks`` into ``state``, chunk by chunk with the next one read meanwhile.

    A tensor already in ``state`` (put in memory by the user since it was stored) wins. Each copy has the strides
    its tensor had in memory (``strides``).

    Args:
        chunks: The chunks whose state is stored.
        read: Starts a chunk's read.
        index: id(parameter) -> position.
        state: A ``state_dict()["state"]``: parameter position -> its state.
        strides: name -> key -> strides, for the tensors that were not contiguous (see ``write_copy``).
    """
    reads: list[SwapIn] = []
    try:
        for k, chunk in enumerate(chunks):
            while len(reads) < 2 and k + len(reads) < len(chunks):
                reads.append(read(chunks[k + len(reads)]))
            pending = reads.pop(0)
            try:
                by_name = chunk.by_name
                for name, tensors in pending.wait().items():
                    values = state.setdefault(index[id(by_name[name])], {})
                    kept = strides.get(name, {})
                    for key, value in tensors.items():
                        if key not in values:
                            values[key] = _given_back(value, kept.get(key))
            finally:
                pending.release()
    finally:
        for pending in reads:
            pending.release()
