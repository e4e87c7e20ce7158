"""``OffloadedOptimizer``: any ``torch.optim`` optimizer whose tensor state lives on storage between steps.

Each step walks the parameters that have gradients in chunks of about ``chunk_bytes`` of state. For each chunk it
reads the state in, runs the wrapped optimizer's own ``step()`` with every param group temporarily restricted to
the chunk's parameters, and writes the (possibly new, resized or re-typed) state back out; chunk k+1 is being read
and chunk k-1 written while chunk k steps. The wrapped optimizer does all the math, parameter by parameter as it
always does, so results are bit-identical to running it in memory. Non-tensor state (ints, floats) stays in memory.

Optimizers that need all parameters at once inside one step (``LBFGS``) are refused.

Distributed training: build the optimizer after wrapping the model (``fully_shard`` for FSDP2, whose DTensor
parameters have their local shard stored; ``DistributedDataParallel``) inside an initialised process group. Each
rank stores only its own state, in ``<folder>/deepoffload-rank<R>-<unique>``; on one machine the ranks share the
base folder safely, across machines each uses its local disk. A multi-node job is only a matter of launching, e.g.
``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import torch

from .config import SwapConfig
from .tensor_swapper import SwapIn, SwapOut, TensorSwapper

UNSUPPORTED = (torch.optim.LBFGS,)


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
        if isinstance(inner, UNSUPPORTED):
            raise TypeError(f"OffloadedOptimizer: {type(inner).__name__} evaluates the loss and keeps state across "
                            f"all parameters inside one step, so it cannot step in chunks; use another optimizer")
        self.optimizer = inner
        self.config = config or SwapConfig()
        self.swapper = TensorSwapper(self.config)
        self._names: dict[torch.Tensor, str] = {}
        self._compute_threads: int | None = None
        self._prefetched: dict[tuple[int, ...], SwapIn] = {}  # chunk (ids of its params) -> read started early
        # What torch.optim.Optimizer.__init__ sets up besides params and state (which live in the wrapped one).
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._swap_out_resident()  # e.g. Adagrad creates its state in __init__

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
        name = self._names.get(param)
        if name is None:
            name = self._names[param] = f"param{len(self._names)}"
        return name

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # -- stepping ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter with a gradient; ``closure`` (if any) is evaluated once first,
        with gradients enabled, and its result returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with _intra_op_threads(self._compute_threads):
            self._run(self._chunks([p for p in self._params() if p.grad is not None]), self._step_chunk)
        return loss

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

    def _step_chunk(self, chunk: list[torch.Tensor]) -> None:
        chosen = set(chunk)
        groups = self.param_groups
        saved = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = [p for p in group["params"] if p in chosen]
            self.optimizer.step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    def _estimate(self, param: torch.Tensor) -> int:
        """Bytes of state a parameter brings into a chunk: on storage, in memory, or (before its first step) a
        guess of two copies of the parameter."""
        state = self.optimizer.state.get(param, {})
        resident = sum(_state_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
        return self.swapper.stored_bytes(self._name(param)) + resident or 2 * _state_bytes(param)

    def _chunks(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        chunks: list[list[torch.Tensor]] = []
        size = 0
        for param in params:
            nbytes = self._estimate(param)
            if not chunks or size + nbytes > self.config.chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(param)
            size += nbytes
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
        try:
            for k, chunk in enumerate(chunks):
                while len(reads) <= ahead and k + len(reads) < len(chunks):
                    following = chunks[k + len(reads)]
                    reads.append(prefetched.pop(tuple(map(id, following)), None) or self._read(following))
                current = reads.pop(0)
                by_name = {self._name(p): p for p in chunk}
                for name, tensors in current.wait().items():
                    self.optimizer.state[by_name[name]].update(tensors)
                if action is not None:
                    action(chunk)
                writes.append(self._write(chunk, current))
                current = None
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
        finally:
            if current is not None:  # its state stays in memory, in use: the buffer leaves the pool
                current.detach()
            for read in reads + list(prefetched.values()):
                read.release()
            for write in writes:
                try:
                    write.wait()
                except OSError as e:
                    error = error or e
        if error is not None:
            raise error

    def _read(self, chunk: list[torch.Tensor]) -> SwapIn:
        return self.swapper.swap_in([self._name(p) for p in chunk if self.swapper.records(self._name(p))])

    def _write(self, chunk: list[torch.Tensor], staged: SwapIn) -> SwapOut:
        written = {p: {k: v for k, v in self.optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
                   for p in chunk}
        written = {p: tensors for p, tensors in written.items() if tensors}

        def drop() -> None:  # the bytes are safe on storage: release the memory
            for param, tensors in written.items():
                state = self.optimizer.state[param]
                for key, tensor in tensors.items():
                    if state.get(key) is tensor:
                        del state[key]

        for param in chunk:  # state that disappeared (or was never there) leaves nothing behind on storage
            if param not in written:
                self.swapper.discard(self._name(param))
        return self.swapper.swap_out({self._name(p): t for p, t in written.items()}, on_done=drop, staged=staged)

    def _swap_out_resident(self) -> None:
        params = [p for p in self._params()
                  if any(isinstance(v, torch.Tensor) for v in self.optimizer.state.get(p, {}).values())]
        self._run(self._chunks(params), None)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` with the tensor state read back from storage (copies the
        caller owns; suitable for ``torch.save``)."""
        self.swapper.wait_all()
        result = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(self._params())}
        state = {}
        for key, values in result["state"].items():
            state[key] = dict(values)
        for param in self._params():
            name = self._name(param)
            if not self.swapper.records(name):
                continue
            read = self.swapper.swap_in([name])
            try:
                tensors = {k: v.clone() for k, v in read.wait()[name].items()}
            finally:
                read.release()
            state.setdefault(index[id(param)], {}).update(tensors)
        result["state"] = state
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (from ``state_dict()`` of this class or of the plain optimizer) and move its tensor
        state to storage."""
        self._drop_prefetched()
        self.swapper.wait_all()
        self.optimizer.load_state_dict(state_dict)
        for param in self._params():
            self.swapper.discard(self._name(param))
        self._swap_out_resident()

    # -- lifetime and figures ---------------------------------------------------------------------------------
    def stored_bytes(self) -> int:
        """Bytes of optimizer state held on storage now."""
        return self.swapper.stored_bytes()

    def close(self) -> None:
        """Finish all IO and remove the swap files (unless ``keep_files``). The optimizer is unusable after."""
        try:
            self._drop_prefetched()
        finally:
            self.swapper.close()

    def __enter__(self) -> "OffloadedOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OffloadedOptimizer({self.optimizer!r}, folder={self.swapper.folder!r})"
