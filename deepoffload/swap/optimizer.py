"""``OffloadedOptimizer``: any ``torch.optim`` optimizer whose tensor state lives on storage between steps.

Each step walks the parameters that have gradients in chunks of about ``chunk_bytes`` of state. For each chunk it
reads the state in, runs the wrapped optimizer's own ``step()`` with every param group temporarily restricted to
the chunk's parameters, and writes the (possibly new, resized or re-typed) state back out; chunk k+1 is being read
and chunk k-1 written while chunk k steps. The wrapped optimizer does all the math, parameter by parameter as it
always does, so results are bit-identical to running it in memory. Non-tensor state (ints, floats) stays in memory,
and so do tensors that share their memory (see ``_shares_memory``). The stored tensors belong to the state entry
left in memory: resetting it resets them (see ``_StoredState``).

Optimizers that need all parameters at once inside one step, or whose ``step`` requires a closure (``LBFGS``),
are refused at construction. The wrapped optimizer is stepped without its own step hooks (its class's ``step``
unwrapped), so step hooks fire once per step, on this wrapper. A step that fails part way leaves each parameter
and its state either fully stepped or untouched, and the error's note says which.

Distributed training: build the optimizer after wrapping the model (``fully_shard`` for FSDP2, whose DTensor
parameters have their local shard stored; ``DistributedDataParallel``) inside an initialised process group. Each
rank stores only its own state, in ``<folder>/deepoffload-rank<R>-<unique>``; on one machine the ranks share the
base folder safely, across machines each uses its local disk. A multi-node job is only a matter of launching, e.g.
``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import torch

from ..io.handle import wait_each
from .config import SwapConfig
from .interrupts import deferred
from .pool import PAGE_SIZE, trim_heap
from .tensor_swapper import SwapIn, SwapOut, TensorSwapper

UNSUPPORTED = (torch.optim.LBFGS,)
_WRAPPED = "_deepoffload_wrapped"  # set on an optimizer once an OffloadedOptimizer has taken its state


def _requires_closure(optimizer: torch.optim.Optimizer) -> bool:
    """True when the optimizer's ``step`` has a first argument without a default (it needs a closure)."""
    try:
        signature = inspect.signature(type(optimizer).step)  # follows torch's hook wrapper to the real step
    except (TypeError, ValueError):
        return False
    params = list(signature.parameters.values())[1:]  # after self
    first = params[0] if params else None
    return (first is not None and first.default is inspect.Parameter.empty
            and first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD))


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """The optimizer's own ``step`` without torch's hook wrapper (which would run every global step hook once per
    chunk, with the wrapped optimizer as argument)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        return functools.partial(step.__wrapped__, optimizer)
    return optimizer.step


def _check_no_step_hooks(optimizer: torch.optim.Optimizer) -> None:
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        raise TypeError("OffloadedOptimizer: the wrapped optimizer has step hooks of its own, which would not run; "
                        "register them on the OffloadedOptimizer (opt.register_step_pre_hook / "
                        "register_step_post_hook) instead")


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    parts: list[str] = []
    for i in indices:
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) or "none"


@contextlib.contextmanager
def _intra_op_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside the block (None: left as it is), then restored."""
    previous = torch.get_num_threads()
    if count is None or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _storable(value: Any) -> bool:
    """A tensor with one byte buffer (strided, not quantized, not on ``meta``); others (e.g. SGD's sparse momentum
    for sparse gradients) stay in memory."""
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_quantized \
        and not value.is_meta


class _StoredState(dict):
    """A parameter's entry in the wrapped optimizer's ``state`` while its tensors are on storage (it holds the
    non-tensor values). The stored tensors belong to this entry: once it is replaced or removed (``opt.state[p] =
    {}``, ``del opt.state[p]``, ``opt.state.clear()``, a new ``opt.state``) or cleared, they are dropped, so the
    optimizer starts that state afresh, as it would in memory."""

    cleared = False

    def clear(self) -> None:
        self.cleared = True
        super().clear()


def _references(values: dict, key: Any) -> int:
    return sys.getrefcount(values[key])


_ALONE = _references({"t": torch.empty(0)}, "t")  # the count for a tensor its state entry alone refers to


def _shares_memory(values: dict, key: Any, bases: set[int]) -> bool:
    """Whether the state tensor ``values[key]`` is reached other than through its entry: referred to from elsewhere
    (another parameter's state, the optimizer, the caller), or a view of another tensor of the entry or viewed by
    one. A copy on storage would stop sharing its memory, so it stays in memory."""
    value = values[key]
    base = value._base
    return (base is not None and any(other is base for other in values.values())) or id(value) in bases \
        or _references(values, key) > _ALONE + 1  # (+1: ``value`` here)


def _holds_stored(values: Any) -> bool:
    """Whether a parameter's state entry still owns the tensors stored for it (see ``_StoredState``)."""
    return type(values) is _StoredState and not values.cleared


class _Chunk(list):
    """Parameters stepped together, with what each step needs of them worked out once: their group names
    (``names``, ``by_name``) and, per param group, the chunk's parameters in it (``in_groups``)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        super().__init__(params)
        self.names: list[str] = []
        self.by_name: dict[str, torch.Tensor] = {}
        self.in_groups: list[list[torch.Tensor]] | None = None


def _state_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") and hasattr(tensor, "placements") else tensor
    return local.numel() * local.element_size()


class OffloadedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` (an instance, or a ``torch.optim.Optimizer`` class or factory called here with
    ``params`` and ``**kwargs``) so that the tensor state of every parameter lives in files between steps.

    ``config``: a ``SwapConfig`` (folder, buffers, chunk bytes, checksums, async-IO settings). Use this object
    wherever the optimizer is used: ``step``, ``zero_grad``, LR schedulers, ``state_dict``/``load_state_dict``
    (which return and take the real state, read from storage). ``state`` shows only what is kept in memory.
    Under ``torch.distributed`` each rank swaps its own (local-shard) state into its own folder.

    Pipelining across steps (off by default): ``prefetch(params)`` starts reading the state a coming step over those
    parameters needs (e.g. while their gradients are being computed). ``step`` returns only once its writes are on
    storage, so a failed write is raised by the step that made it, with that state still in memory.

    ``compute_threads`` (None by default: torch's setting is left alone): torch's intra-op threads while ``step``
    runs, restored after. With few cores, compute threads on every core starve the IO threads and the disk idles
    between transfers; leaving one core to IO (e.g. 1 on 2 cores) made a 1 GB Adam step markedly faster on a shared
    2-core machine (benchmarks/optimizer_offload.py prints both). Elementwise optimizers (Adam, AdamW, SGD, Adagrad,
    RMSprop) give the same bits at any thread count; one whose step reduces a large tensor (e.g. Adafactor's norm)
    matches the in-memory optimizer run with the same thread count. Process-wide while the step runs.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | type, params: Iterable | None = None,
                 config: SwapConfig | None = None, **kwargs: Any):
        if isinstance(optimizer, torch.optim.Optimizer):
            if params is not None or kwargs:
                raise TypeError("OffloadedOptimizer: pass either an optimizer instance, or an optimizer class with "
                                "params and its keyword arguments, not both")
            inner = optimizer
        elif callable(optimizer):
            if params is None:
                raise TypeError(f"OffloadedOptimizer: building {getattr(optimizer, '__name__', optimizer)!r} needs "
                                f"params")
            inner = optimizer(params, **kwargs)
            if not isinstance(inner, torch.optim.Optimizer):
                raise TypeError(f"OffloadedOptimizer: {optimizer!r} built a {type(inner).__name__}, not a "
                                f"torch.optim.Optimizer")
        else:
            raise TypeError(f"OffloadedOptimizer: expected a torch.optim.Optimizer instance or class, got "
                            f"{optimizer!r}")
        if isinstance(inner, OffloadedOptimizer):
            raise TypeError("OffloadedOptimizer: the optimizer is already offloaded")
        if isinstance(inner, UNSUPPORTED) or _requires_closure(inner):
            raise TypeError(f"OffloadedOptimizer: {type(inner).__name__}.step requires a closure (it evaluates the "
                            f"loss inside its step, across all parameters), so it cannot step in chunks; use an "
                            f"optimizer whose step works without a closure")
        if getattr(inner, _WRAPPED, False):
            raise TypeError(f"OffloadedOptimizer: this {type(inner).__name__} is already wrapped by an "
                            f"OffloadedOptimizer, which moved its tensor state to storage; use that wrapper (or build "
                            f"a new optimizer: wrapping it again would silently restart its state)")
        _check_no_step_hooks(inner)
        setattr(inner, _WRAPPED, True)
        self.optimizer = inner
        self._inner_step = _unhooked_step(inner)
        self.config = config or SwapConfig()
        self.swapper = TensorSwapper(self.config, packed=True)
        self._names: dict[int, str] = {}  # id(param) -> its group name (params stay alive in param_groups)
        self._compute_threads: int | None = None
        self._prefetched: dict[tuple[int, ...], SwapIn] = {}  # chunk (ids of its params) -> read started early
        self._backward: _BackwardSteps | None = None  # step_in_backward's plan and progress, when on
        self._plans: dict[tuple, list[_Chunk]] = {}  # chunk plans made at ``_plans_version`` of the swapper
        self._plans_version = -1
        self._copied = False  # state held in ordinary memory was stored since the heap was last trimmed
        self._loading = False  # load_state_dict is storing the loaded state
        self._trimmed_at = 0  # swapper.bytes_read at the last trim
        # What torch.optim.Optimizer.__init__ sets up besides params and state (which live in the wrapped one).
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        try:
            self._swap_out_resident()  # e.g. Adagrad creates its state in __init__
        except BaseException as e:
            self._unwrap(e)
            raise

    def _unwrap(self, error: BaseException) -> None:
        """Construction failed (e.g. a full disk): the state stored so far goes back into the wrapped optimizer's
        memory, its swap files are removed, and it can be wrapped again."""
        try:
            saved = self._gather_state_dict()["state"]
            params = self._params()
            for index, values in saved.items():
                self.optimizer.state[params[index]] = values
            delattr(self.optimizer, _WRAPPED)
        except BaseException as failed:
            if hasattr(error, "add_note"):
                error.add_note(f"OffloadedOptimizer: the state already stored could not be read back into the "
                               f"{type(self.optimizer).__name__} ({failed!r}); build a new optimizer")
        finally:
            try:
                self.swapper.close()
            except OSError as failed:
                if hasattr(error, "add_note"):
                    error.add_note(f"OffloadedOptimizer: closing its swap files failed too: {failed!r}")

    # -- the wrapped optimizer's params and in-memory state --------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        """The wrapped optimizer's state as kept in memory: non-tensor values only, between steps."""
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    @property
    def compute_threads(self) -> int | None:
        """torch intra-op threads while ``step`` runs (None: unchanged); see the class docstring."""
        return self._compute_threads

    @compute_threads.setter
    def compute_threads(self, count: int | None) -> None:
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"compute_threads: expected a positive number of threads or None (torch's setting), "
                             f"got {count!r}")
        self._compute_threads = count

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def _name(self, param: torch.Tensor) -> str:
        name = self._names.get(id(param))
        if name is None:
            name = self._names[id(param)] = f"param{len(self._names)}"
        return name

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # -- stepping ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter with a gradient; ``closure`` (if any) is evaluated once first,
        with gradients enabled, and its result returned (the wrapped optimizer steps without it).

        If the step fails part way (a read fails, the wrapped optimizer raises), the parameters of the chunks
        already stepped keep their step and its state, the others are untouched with their state as before; the
        error carries a note listing both (positions in ``param_groups`` order). A failed write does not stop the
        step: every parameter is stepped, that state stays in memory, and the ``OSError`` is raised at the end."""
        _check_no_step_hooks(self.optimizer)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._backward is not None:
            with deferred():
                self._backward.finish()
            return loss
        with deferred(), _intra_op_threads(self._compute_threads):  # Ctrl-C: once the whole step is done
            try:
                self._run(self._chunks([p for p in self._params() if p.grad is not None]), self._step_chunk)
            finally:
                self._trim()
        return loss

    def step_in_backward(self, enabled: bool = True) -> None:
        """Opt-in overlap with the backward pass: each chunk of parameters (planned in reverse order, as backward
        produces gradients) steps as soon as all its gradients are accumulated, inside ``backward()``, while the
        next chunks' state is read; the first chunks' state is read during the forward pass. ``step()`` then
        steps the parameters whose chunk did not complete (e.g. some got no gradient) and waits for the writes.
        Results are bit-identical to the plain optimizer.

        Requires one ``backward()`` per ``step()`` and gradients used as backward leaves them: a second backward
        before ``step()`` (gradient accumulation) raises in that backward; gradients changed after backward
        (clipping, GradScaler's unscale) are detected at ``step()``, which raises. Step pre-hooks run at
        ``step()``, after most parameters were stepped. ``enabled=False`` returns to stepping in ``step()``."""
        if enabled and self._backward is None:
            self._backward = _BackwardSteps(self)
        elif not enabled and self._backward is not None:
            self._backward.close()
            self._backward = None

    def _note_stopped(self, error: BaseException, chunks: list[list[torch.Tensor]], stepped: int,
                      failed_inside: bool) -> None:
        """Say on ``error`` which parameters the interrupted step changed and which it did not."""
        position = {id(p): i for i, p in enumerate(self._params())}
        done = sorted(position[id(p)] for chunk in chunks[:stepped] for p in chunk)
        rest = sorted(position[id(p)] for chunk in chunks[stepped:] for p in chunk)
        note = (f"OffloadedOptimizer.step stopped: parameters {_ranges(done)} (positions in param_groups order) "
                f"were fully stepped, their state stored or kept in memory; parameters {_ranges(rest)} were not "
                f"stepped and their state is as before the step")
        if failed_inside:
            failing = sorted(position[id(p)] for p in chunks[stepped])
            note += (f" (the wrapped optimizer raised while stepping {_ranges(failing)}: they are as it left them; "
                     f"torch's optimizers check their inputs before changing anything)")
        if hasattr(error, "add_note"):
            error.add_note(note)

    def prefetch(self, params: Iterable[torch.Tensor]) -> None:
        """Start reading the stored state of ``params`` in the chunks a ``step()`` over exactly these parameters
        (those with a gradient then) will use; that step waits only for what is still in flight. Reads the step
        does not use are released when it starts. Costs staging buffers until then (see ``SwapConfig``)."""
        chosen = set(params)
        for chunk in self._chunks([p for p in self._params() if p in chosen]):
            key = tuple(map(id, chunk))
            if key not in self._prefetched:
                self._prefetched[key] = self._read(chunk)

    def _drop_prefetched(self, keep: set[tuple[int, ...]] = frozenset()) -> dict[tuple[int, ...], SwapIn]:
        """Release the prefetched reads not in ``keep``; return (and forget) the others."""
        kept, prefetched, self._prefetched = {}, self._prefetched, {}
        for key, read in prefetched.items():
            if key in keep:
                kept[key] = read
            else:
                read.release()
        return kept

    def _step_chunk(self, chunk: _Chunk) -> None:
        groups = self.param_groups
        saved = [group["params"] for group in groups]
        if chunk.in_groups is None or len(chunk.in_groups) != len(groups):
            chosen = set(map(id, chunk))
            chunk.in_groups = [[p for p in params if id(p) in chosen] for params in saved]
        try:
            for group, params in zip(groups, chunk.in_groups):
                group["params"] = params
            self._inner_step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    def _estimate(self, param: torch.Tensor) -> int:
        """Bytes of staging buffer a parameter's state takes in a chunk (on storage, in memory, or before its first
        step a guess of two copies of the parameter), with the alignment padding of each of its tensors."""
        state = self.optimizer.state.get(param)
        resident = [v for v in state.values() if isinstance(v, torch.Tensor)] if state else []
        name = self._name(param)
        count = len(resident) + len(self.swapper.records(name)) if self.swapper.has(name) else len(resident)
        nbytes = self.swapper.stored_bytes(name) + sum(_state_bytes(v) for v in resident)
        if not nbytes:
            nbytes, count = 2 * _state_bytes(param), 3
        return nbytes + self.swapper.tensor_alignment * count

    def _chunks(self, params: list[torch.Tensor]) -> list[_Chunk]:
        """Consecutive parameters whose state fills at most one pooled buffer (``chunk_bytes`` less a page for
        the extent's padding), so a step's buffers come from the bounded pool; when one parameter's state is
        larger, chunks hold up to it plus a sixteenth and the pool's buffers grow to the fullest chunk. The plan is
        reused while the same parameters (in the same param groups) are stepped and no stored state changed size or
        place."""
        version = self.swapper.version
        if version != self._plans_version:
            self._plans, self._plans_version = {}, version
        key = (tuple(map(id, params)), tuple((id(g["params"]), len(g["params"])) for g in self.param_groups))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        estimates = [self._estimate(param) for param in params]
        # A parameter whose state exceeds chunk_bytes would need a fresh buffer each step, made on the step's thread
        # and faulted in during the read (O_DIRECT reads into fresh 4 KiB pages: 0.4-1.0 GB/s here, into faulted-in
        # ones 2.3 GB/s): the pool's buffers grow to hold it instead (with a sixteenth to spare, so the small
        # parameters beside it, e.g. its bias, travel in its chunk rather than taking a buffer of their own), and
        # chunks fill them.
        largest = max(estimates, default=0)
        budget = max(1, self.config.chunk_bytes - PAGE_SIZE, self.swapper.pool.buffer_bytes - PAGE_SIZE,
                     largest + largest // 16 if largest > self.config.chunk_bytes - PAGE_SIZE else 0)
        chunks: list[_Chunk] = []
        size = fullest = 0
        for param, nbytes in zip(params, estimates):
            if not chunks or size + nbytes > budget:
                chunks.append(_Chunk())
                size = 0
            chunks[-1].append(param)
            size += nbytes
            fullest = max(fullest, size)
        self.swapper.pool.fit(fullest + PAGE_SIZE)
        for chunk in chunks:
            chunk.names = [self._name(p) for p in chunk]
            chunk.by_name = dict(zip(chunk.names, chunk))
        if len(self._plans) >= 8:  # a few plans (e.g. step, state_dict, step_in_backward's): bounded
            self._plans.clear()
        self._plans[key] = chunks
        return chunks

    def _run(self, chunks: list[list[torch.Tensor]], action: Callable[[list[torch.Tensor]], None] | None) -> None:
        """Read chunks k+1.. and write chunk k-1 while ``action`` runs on chunk k; return once every write is done
        A failed write does not stop the step: its state stays
        in memory and the first such error is raised at the end. A failed read stops it (that chunk cannot step).
        Transfers in flight always finish first when it stops."""
        writes: list[SwapOut] = []
        prefetched = self._drop_prefetched({tuple(map(id, chunk)) for chunk in chunks})
        reads: list[SwapIn] = []
        current: SwapIn | None = None
        error: OSError | None = None  # a failed write: the step still completes (that state stays in memory)
        ahead = max(1, self.config.buffer_count - 2)  # chunks read ahead; one buffer steps, one writes behind
        stepped, inside = 0, False  # chunks whose action finished; whether the action itself raised
        try:
            for k, chunk in enumerate(chunks):
                while len(reads) <= ahead and k + len(reads) < len(chunks):
                    following = chunks[k + len(reads)]
                    reads.append(prefetched.pop(tuple(map(id, following)), None) or self._read(following))
                current = reads.pop(0)
                self._restore(chunk, current)
                if action is not None:
                    inside = True
                    action(chunk)
                    inside = False
                stepped = k + 1
                writes.append(self._write(chunk, current))
                current = None
                self._trim()
                pending = []
                for write in writes:  # collect finished writes early: their memory is released sooner
                    if not write.done():
                        pending.append(write)
                        continue
                    try:
                        write.wait()
                    except OSError as e:
                        error = error or e
                writes = pending
        except BaseException as e:
            if action is not None:
                self._note_stopped(e, chunks, stepped, inside)
            raise
        finally:
            if current is not None:  # its state stays in memory, in use: the buffer leaves the pool
                current.detach()
            for read in reads + list(prefetched.values()):
                read.release()
            failed = wait_each(writes)
            error = error or failed
        if error is not None:
            raise error

    def _trim(self) -> None:
        """Return freed heap pages to the system (``trim_heap``, which costs milliseconds) once state that lived in
        ordinary memory was stored and freed, or half of ``chunk_bytes`` of state was read since the last time.
        Freeing such state raises glibc's mmap threshold, after which the step's temporaries come from the heap;
        without this the heap keeps growing through the step (measured: 1 GB of Adam state, 30-40 MB more peak)."""
        read = self.swapper.bytes_read
        if self._copied or read - self._trimmed_at >= self.config.chunk_bytes // 2:
            self._copied, self._trimmed_at = False, read
            trim_heap()

    def _read(self, chunk: _Chunk) -> SwapIn:
        has = self.swapper.has
        return self.swapper.swap_in([name for name in chunk.names if has(name)])

    def _restore(self, chunk: _Chunk, read: SwapIn) -> None:
        """Put a chunk's state, read from storage, into the wrapped optimizer's state."""
        state, by_name = self.optimizer.state, chunk.by_name
        for name, tensors in read.wait().items():
            values = state.get(by_name[name])
            if not _holds_stored(values):
                continue  # the user reset this state since it was stored: the optimizer starts it afresh
            if values:  # a tensor the user put there since wins over the stored one, as it would in memory
                for key, tensor in tensors.items():
                    values.setdefault(key, tensor)
            else:
                values.update(tensors)

    def _write(self, chunk: _Chunk, staged: SwapIn) -> SwapOut:
        write = self._write_back(chunk, staged)
        if write is not None:
            return write
        state = self.optimizer.state
        self._copied = True
        written = {}
        read = staged.wait()
        for p, name in zip(chunk, chunk.names):
            values = state.get(p)
            tensors = {k: v for k, v in values.items() if _storable(v)} if values else None
            if tensors and not self._loading:  # (a loaded state's tensors may still be the caller's: copied)
                views = read.get(name, {})
                bases = {id(v._base) for v in tensors.values() if v._base is not None}
                del tensors
                tensors = {k: values[k] for k in list(values) if _storable(values[k])
                           and (values[k] is views.get(k) or not _shares_memory(values, k, bases))}
            if tensors:
                written[p] = tensors
                if not _holds_stored(values):
                    state[p] = _StoredState(values)

        def drop() -> None:  # the bytes are safe on storage: release the memory
            for param, tensors in written.items():
                state = self.optimizer.state[param]
                for key, tensor in tensors.items():
                    if state.get(key) is tensor:
                        del state[key]

        if len(written) < len(chunk):
            for param, name in zip(chunk, chunk.names):  # state that disappeared (or was never there) leaves
                if param not in written:                 # nothing behind on storage
                    self.swapper.discard(name)
        names = self._names
        write = self.swapper.swap_out({names[id(p)]: t for p, t in written.items()}, on_done=drop, staged=staged)
        # The staging buffer now holds the bytes: the state's own tensors (e.g. made in ordinary memory by the
        # first step) are freed now, not when the write is done; the state holds views of the buffer meanwhile.
        for name, views in write.staged().items():
            param = chunk.by_name[name]
            values, tensors = state[param], written[param]
            for key, view in views.items():
                if values.get(key) is tensors[key]:
                    values[key] = tensors[key] = view
        return write

    def _write_back(self, chunk: _Chunk, staged: SwapIn) -> SwapOut | None:
        """The common case, cheaply: every parameter's state holds exactly the tensors read (stepped in place,
        none added, replaced or removed), so the read's buffer is written back as it is. None otherwise."""
        read = staged.wait()
        if len(read) != len(chunk):
            return None
        state, pairs = self.optimizer.state, []
        for param, name in zip(chunk, chunk.names):
            values, views = state.get(param), read.get(name)
            if not _holds_stored(values) or views is None or len(values) != len(views):
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

        return self.swapper.write_back(staged, on_done=drop)

    def _swap_out_resident(self) -> None:
        params = [p for p in self._params() if any(_storable(v) for v in self.optimizer.state.get(p, {}).values())]
        try:
            self._run(self._chunks(params), None)
        finally:
            self._trim()

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` with the tensor state read back from storage (copies the
        caller owns; suitable for ``torch.save``). State-dict hooks registered on this wrapper run as torch's do."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        result = self._gather_state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            changed = hook(self, result)
            if changed is not None:
                result = changed
        return result

    def _gather_state_dict(self) -> dict[str, Any]:
        self._drop_prefetched()
        self.swapper.wait_all()
        result = self.optimizer.state_dict()
        state = {key: dict(values) for key, values in result["state"].items()}
        params = self._params()
        index = {id(p): i for i, p in enumerate(params)}
        for p in params:  # state the user reset since it was stored
            if self.swapper.has(self._name(p)) and not _holds_stored(self.optimizer.state.get(p)):
                self.swapper.discard(self._name(p))
        chunks = self._chunks([p for p in params if self.swapper.has(self._name(p))])
        reads: list[SwapIn] = []
        try:
            for k, chunk in enumerate(chunks):  # chunk by chunk, the next one read meanwhile
                while len(reads) < 2 and k + len(reads) < len(chunks):
                    reads.append(self._read(chunks[k + len(reads)]))
                read = reads.pop(0)
                try:
                    by_name = chunk.by_name
                    for name, tensors in read.wait().items():
                        values = state.setdefault(index[id(by_name[name])], {})
                        for key, value in tensors.items():  # a tensor the user put in memory since wins
                            if key not in values:
                                values[key] = value.clone()
                finally:
                    read.release()
        finally:
            for read in reads:
                read.release()
        result["state"] = state
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (from ``state_dict()`` of this class or of the plain optimizer) and move its tensor
        state to storage. Load-state-dict hooks registered on this wrapper run as torch's do."""
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            changed = hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        self._drop_prefetched()
        self.swapper.wait_all()
        self.optimizer.load_state_dict(state_dict)
        for param in self._params():
            self.swapper.discard(self._name(param))
        self._loading = True
        try:
            self._swap_out_resident()
        finally:
            self._loading = False
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # -- lifetime and figures ---------------------------------------------------------------------------------
    def stored_bytes(self) -> int:
        """Bytes of optimizer state held on storage now."""
        return self.swapper.stored_bytes()

    def _close_backward(self) -> None:
        if self._backward is not None:
            self._backward.close()
            self._backward = None

    def close(self) -> None:
        """Finish all IO and remove the swap files (unless ``keep_files``). The optimizer is unusable after."""
        try:
            self._close_backward()
            self._drop_prefetched()
        finally:
            self.swapper.close()

    def __enter__(self) -> "OffloadedOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("OffloadedOptimizer cannot be pickled, copied or deep-copied (torch.save(opt) included): "
                        "its tensor state lives in swap files this object owns. Save opt.state_dict() (the real "
                        "state, read from storage) and load it with load_state_dict() into a new OffloadedOptimizer")

    def __repr__(self) -> str:
        return f"OffloadedOptimizer({self.optimizer!r}, folder={self.swapper.folder!r})"


class _BackwardSteps:
    """``step_in_backward``: the chunks (reverse parameter order), which of their gradients are ready, which chunks
    stepped in this backward, and their writes."""

    def __init__(self, optimizer: OffloadedOptimizer):
        self.optimizer = optimizer
        self.ready: list[set[int]] = []
        self.stepped: dict[int, int] = {}  # id(param) -> its gradient's version when it was stepped
        self.entries: dict[int, Any] = {}  # id(param) -> its state entry once stepped (to see a reset before step())
        self.writes: list[SwapOut] = []
        self.error: OSError | None = None
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                        for p in optimizer._params() if p.requires_grad]
        self._plan()

    def _plan(self) -> None:
        """Chunks for the coming backward, and their first ones' state read now (during the forward)."""
        opt = self.optimizer
        self.chunks = opt._chunks([p for p in reversed(opt._params()) if p.requires_grad])
        self.index = {id(p): k for k, chunk in enumerate(self.chunks) for p in chunk}
        self.ready = [set() for _ in self.chunks]
        self.next = 0  # reads are started for chunks from here on, in plan order
        self._read_ahead()

    def _read_ahead(self, wait: bool = True) -> None:
        """Start the reads of the coming chunks, up to ``buffer_count - 2`` in flight; unless ``wait``, only while
        a staging buffer is free (no waiting for a write to free one)."""
        opt = self.optimizer
        ahead = max(1, opt.config.buffer_count - 2)
        while self.next < len(self.chunks) and len(opt._prefetched) < ahead \
                and (wait or opt.swapper.pool.available()):
            chunk = self.chunks[self.next]
            self.next += 1
            if len(self.ready[self.next - 1]) < len(chunk):
                opt._prefetched[tuple(map(id, chunk))] = opt._read(chunk)

    def _on_grad(self, param: torch.Tensor) -> None:
        if id(param) in self.stepped:
            raise RuntimeError("OffloadedOptimizer.step_in_backward: a second backward() before step() (gradient "
                               "accumulation?); each parameter already stepped with the first backward's gradient. "
                               "Call step() after every backward, or opt.step_in_backward(False)")
        k = self.index.get(id(param))
        if k is None:
            return
        self.ready[k].add(id(param))
        if len(self.ready[k]) == len(self.chunks[k]):
            with deferred(), torch.no_grad(), _intra_op_threads(self.optimizer._compute_threads):
                self._step(k)  # (a Ctrl-C is raised once the chunk is stepped: it then ends the backward)

    def _step(self, k: int) -> None:
        opt, chunk = self.optimizer, self.chunks[k]
        read = opt._prefetched.pop(tuple(map(id, chunk)), None) or opt._read(chunk)
        applied = False
        try:
            # The next chunks' reads go first: they start during this chunk's compute, queued before its write (one
            # IO thread serves requests in order, and the next chunk waits for its read, not for a write).
            self._collect_done()
            self.next = max(self.next, k + 1)
            self._read_ahead(wait=False)
            opt._restore(chunk, read)
            applied = True
            opt._step_chunk(chunk)
            self.writes.append(opt._write(chunk, read))
        except BaseException:
            if applied:
                read.detach()  # the state is in use (in memory): its buffer leaves the pool
            else:
                read.release()
            raise
        opt._trim()
        for p in chunk:
            self.stepped[id(p)] = p.grad._version
            self.entries[id(p)] = opt.optimizer.state.get(p)
        self._collect_done()
        self._read_ahead()

    def _collect_done(self) -> None:
        """Collect finished writes early: their memory is released (and their buffers freed) sooner."""
        pending = []
        for write in self.writes:
            if write.done():
                self._collect(write)
            else:
                pending.append(write)
        self.writes = pending

    def _collect(self, write: SwapOut) -> None:
        try:
            write.wait()
        except OSError as e:
            self.error = self.error or e

    def finish(self) -> None:
        """``step()``: check the gradients used were not changed since, step what is left, wait for the writes,
        plan the next backward."""
        opt = self.optimizer
        changed = [p for p in opt._params() if id(p) in self.stepped and (p.grad is None or
                                                                        p.grad._version != self.stepped[id(p)])]
        try:
            if changed:
                raise RuntimeError(f"OffloadedOptimizer.step_in_backward: the gradients of {len(changed)} "
                                   f"parameter(s) changed after backward stepped them (gradient clipping, "
                                   f"GradScaler unscaling, zero_grad before step?); those parameters took their "
                                   f"step with the unchanged gradients. Turn step_in_backward off to clip or "
                                   f"scale gradients")
            state, entries = opt.optimizer.state, self.entries
            reset = [p for p in opt._params() if id(p) in entries and (state.get(p) is not entries[id(p)] or (
                type(entries[id(p)]) is _StoredState and entries[id(p)].cleared))]
            if reset:
                raise RuntimeError(f"OffloadedOptimizer.step_in_backward: the state of {len(reset)} parameter(s) "
                                   f"was reset (opt.state replaced or cleared, an entry deleted, replaced or "
                                   f"cleared) after backward stepped them with the state before; the reset applies "
                                   f"from the next step. Reset state before backward, or turn step_in_backward off")
            rest = [p for p in opt._params() if p.grad is not None and id(p) not in self.stepped]
            with _intra_op_threads(opt._compute_threads):
                opt._run(opt._chunks(rest), opt._step_chunk)
        finally:
            for write in self.writes:
                self._collect(write)
            opt._trim()
            self.writes, self.stepped, self.entries = [], {}, {}
            error, self.error = self.error, None
            opt._drop_prefetched()
            self._plan()
        if error is not None:
            raise error

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for write in self.writes:
            self._collect(write)
        self.writes = []
        self.optimizer._drop_prefetched()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
