"""``OffloadedOptimizer``: any ``torch.optim`` optimizer whose tensor state lives on storage between steps.

Each step walks the parameters that have gradients in chunks of about ``chunk_bytes`` of state. For each chunk it reads
the state in, runs the wrapped optimizer's own ``step()`` with every param group temporarily restricted to the chunk's
parameters, and writes the (possibly new, resized or re-typed) state back out; chunk k+1 is being read and chunk k-1
written while chunk k steps. The wrapped optimizer does all the math, parameter by parameter as it always does, so
results are bit-identical to running it in memory (``tests/swap/optimizer/test_optimizer_matrix.py``) for an optimizer
whose step reads each parameter alone: torch's built-in classes, or one declared ``per_parameter=True``; one declared
``per_parameter=False`` steps once over all parameters, its whole state in one staging buffer; any other is refused at
construction (``torch_optim.per_parameter``). Non-tensor state (ints, floats) stays in memory, and so do tensors that
share their memory (see ``optimizer_state._shares_memory``). The stored tensors belong to the state entry left in
memory: resetting it resets them (see ``optimizer_state.StoredState``).

Optimizers whose ``step`` requires a closure (``LBFGS``) are refused at construction. The wrapped optimizer is stepped
without its own step hooks (its class's ``step`` unwrapped), so step hooks fire once per step, on this wrapper. A step
that fails part way leaves each parameter and its state either fully stepped or untouched, and the error's note says
which.

Distributed training: build the optimizer after wrapping the model (``fully_shard`` for FSDP2, whose DTensor
parameters have their local shard stored; ``DistributedDataParallel``) inside an initialised process group. Each
rank stores only its own state, in ``<folder>/deepoffload-rank<R>-<unique>``; on one machine the ranks share the
base folder safely, across machines each uses its local disk. A multi-node job is only a matter of launching, e.g.
``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch

from ..errors import UnsupportedError
from .backward_steps import BackwardSteps
from .config import SwapConfig
from .ddp import refuse_step_in_backward_under_ddp
from .interrupts import deferred
from .memory import parse_bytes, process_bytes
from .optimizer_budget import fit_buffers
from .optimizer_pipeline import ChunkPipeline
from .optimizer_state import holds_stored, read_stored
from .tensor_swapper import TensorSwapper
from .torch_optim import (
    UNSUPPORTED,
    WRAPPED,
    check_no_step_hooks,
    intra_op_threads,
    requires_closure,
    unhooked_step,
)
from .torch_optim import (
    per_parameter as per_parameter_,
)


class OffloadedOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim`` optimizer so that the tensor state of every parameter lives in files between steps.

    Use this object wherever the optimizer is used: ``step``, ``zero_grad``, LR schedulers,
    ``state_dict``/``load_state_dict`` (which return and take the real state, read from storage). ``state`` shows
    only what is kept in memory. Under ``torch.distributed`` each rank swaps its own (local-shard) state into its own
    folder.

    Pipelining across steps: as ``step`` ends, it starts reading the state of the first chunks the next step over
    the same parameters steps (as many as a step reads ahead, in the pool's buffers: no memory added), so that step
    starts stepping at once, its first reads done during forward and backward (``read_ahead``, True by default; set
    it False to read nothing between steps). ``prefetch(params)`` starts reading the state a coming step over other
    parameters needs. ``step`` returns only once its writes are on storage, so a failed write is raised by the step
    that made it, with that state still in memory.

    ``compute_threads`` (None by default: torch's setting is left alone): torch's intra-op threads while ``step``
    runs, restored after. With few cores, compute threads on every core starve the IO threads and the disk idles
    between transfers; leaving one core to IO (e.g. 1 on 2 cores) made a 1 GB Adam step markedly faster on a shared
    2-core machine (benchmarks/optimizer_offload.py prints both). Elementwise optimizers (Adam, AdamW, SGD, Adagrad,
    RMSprop) give the same bits at any thread count; one whose step reduces a large tensor (e.g. Adafactor's norm)
    matches the in-memory optimizer run with the same thread count. Process-wide while the step runs.

    Usable as a context manager (``close`` on exit). It cannot be pickled or copied: save its ``state_dict()``.

    Args:
        optimizer: The optimizer to wrap: an instance, or a ``torch.optim.Optimizer`` class or factory called here
            with ``params`` and ``**kwargs``.
        params: The parameters (or param groups) for a class or factory; None with an instance.
        config: A ``SwapConfig`` (folder, buffers, chunk bytes, checksums, async-IO settings; default:
            ``SwapConfig()``).
        max_memory: The process's limit (bytes, or "6GB"); the config's ``buffer_count`` and ``chunk_bytes`` are
            lowered to fit the process as measured now, the gradients, temporaries and 64 MiB of activations, or
            ``MemoryBudgetError`` (a ``MemoryError``) names the least limit that works (``optimizer_budget``).
            None: no limit.
        per_parameter: Whether the optimizer's step reads each parameter's gradient and state alone (True: it
            steps in chunks), or may read several (False: every step runs it once over all parameters, the whole
            state in one staging buffer). None: known only for torch's built-in optimizer classes (True); another
            says it with a bool ``deepoffload_per_parameter`` attribute, or is refused.
        **kwargs: The keyword arguments of a class or factory (e.g. ``lr``); none with an instance.

    Raises:
        TypeError: When ``optimizer`` is neither an optimizer instance nor a class or factory that builds one, an
            instance comes with ``params`` or keyword arguments, a class comes without ``params``, the optimizer
            is already offloaded or wrapped, its ``step`` requires a closure (``LBFGS``), or it has step hooks.
        MemoryBudgetError: When ``max_memory`` is too small (the message names the least limit that works).
        UnsupportedError: When it is not known whether the optimizer's step reads each parameter alone (not one of
            torch's built-in classes, and not declared): stepped in chunks it could silently change.

    Examples:
        >>> import torch
        >>> from deepoffload import OffloadedOptimizer, SwapConfig
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(4, 2)
        >>> config = SwapConfig(folder=".", pin=False)
        >>> opt = OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=1e-3)
        >>> for _ in range(3):
        ...     model(torch.randn(8, 4)).square().mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        >>> opt.stored_bytes()  # exp_avg, exp_avg_sq and step of the weight and the bias
        88
        >>> opt.state_dict()["state"][0]["step"]
        tensor(3.)
        >>> opt.close()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer],
        params: Iterable | None = None,
        config: SwapConfig | None = None,
        *,
        max_memory: int | str | None = None,
        per_parameter: bool | None = None,
        **kwargs: Any,
    ):
        if isinstance(optimizer, torch.optim.Optimizer):
            if params is not None or kwargs:
                raise TypeError(
                    "OffloadedOptimizer: pass either an optimizer instance, or an optimizer class with "
                    "params and its keyword arguments, not both"
                )
            inner = optimizer
        elif callable(optimizer):
            if params is None:
                raise TypeError(
                    f"OffloadedOptimizer: building {getattr(optimizer, '__name__', optimizer)!r} needs params"
                )
            inner = optimizer(params, **kwargs)
            if not isinstance(inner, torch.optim.Optimizer):
                raise TypeError(
                    f"OffloadedOptimizer: {optimizer!r} built a {type(inner).__name__}, not a torch.optim.Optimizer"
                )
        else:
            raise TypeError(
                f"OffloadedOptimizer: expected a torch.optim.Optimizer instance or class, got {optimizer!r}"
            )
        if isinstance(inner, OffloadedOptimizer):
            raise TypeError("OffloadedOptimizer: the optimizer is already offloaded")
        if isinstance(inner, UNSUPPORTED) or requires_closure(inner):
            raise TypeError(
                f"OffloadedOptimizer: {type(inner).__name__}.step requires a closure (it evaluates the "
                f"loss inside its step, across all parameters), so it cannot step in chunks; use an "
                f"optimizer whose step works without a closure"
            )
        if getattr(inner, WRAPPED, False):
            raise TypeError(
                f"OffloadedOptimizer: this {type(inner).__name__} is already wrapped by an "
                f"OffloadedOptimizer, which moved its tensor state to storage; use that wrapper (or build "
                f"a new optimizer: wrapping it again would silently restart its state)"
            )
        check_no_step_hooks(inner)
        known = per_parameter_(inner, per_parameter)
        if known is None:
            raise UnsupportedError(
                f"OffloadedOptimizer: {type(inner).__name__} is not one of torch's built-in optimizers, so it is "
                f"not known whether its step reads each parameter alone; stepped chunk by chunk, a step that reads "
                f"several (a global gradient norm, a trust ratio over a group) would silently change. Pass "
                f"per_parameter=True if its step reads only each parameter's own gradient and state (or set "
                f"{type(inner).__name__}.deepoffload_per_parameter = True), or per_parameter=False to step it "
                f"over all parameters at once (its whole state in memory during each step)"
            )
        self.per_parameter: bool = known
        config = config or SwapConfig()
        if max_memory is not None:  # before anything is wrapped or stored
            params_ = [p for group in inner.param_groups for p in group["params"]]
            config = fit_buffers(
                params_, parse_bytes(max_memory), process_bytes(), config, whole=not self.per_parameter
            )
        setattr(inner, WRAPPED, True)
        self.optimizer = inner
        self.config = config
        self.swapper = TensorSwapper(self.config, packed=True)
        self.pipeline = ChunkPipeline(inner, unhooked_step(inner), self.swapper, config, self.per_parameter)
        self._compute_threads: int | None = None
        self.read_ahead = True  # start the next step's first reads as a step ends (class docstring)
        self._backward: BackwardSteps | None = None  # step_in_backward's plan and progress, when on
        self._busy = threading.RLock()  # step, state_dict, load_state_dict, close: one at a time (others wait)
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
            self.pipeline.swap_out_resident()  # e.g. Adagrad creates its state in __init__
        except BaseException as e:
            self._unwrap(e)
            raise

    def _unwrap(self, error: BaseException) -> None:
        """Undo a construction that failed (e.g. a full disk), noting on ``error`` what could not be undone.

        The state stored so far goes back into the wrapped optimizer's memory, its swap files are removed, and it
        can be wrapped again.
        """
        try:
            saved = self._gather_state_dict()["state"]
            params = self.pipeline.params()
            for index, values in saved.items():
                self.optimizer.state[params[index]] = values
            delattr(self.optimizer, WRAPPED)
        except BaseException as failed:
            if hasattr(error, "add_note"):
                error.add_note(
                    f"OffloadedOptimizer: the state already stored could not be read back into the "
                    f"{type(self.optimizer).__name__} ({failed!r}); build a new optimizer"
                )
        finally:
            try:
                self.swapper.close()
            except OSError as failed:
                if hasattr(error, "add_note"):
                    error.add_note(f"OffloadedOptimizer: closing its swap files failed too: {failed!r}")

    # -- the wrapped optimizer's params and in-memory state --------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (the same list; setting it sets theirs)."""
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
        """Add a param group to the wrapped optimizer.

        Args:
            param_group: The group: its ``params`` and the options that differ from the defaults.
        """
        self.optimizer.add_param_group(param_group)

    @property
    def compute_threads(self) -> int | None:
        """torch intra-op threads while ``step`` runs (None: unchanged); see the class docstring."""
        return self._compute_threads

    @compute_threads.setter
    def compute_threads(self, count: int | None) -> None:
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(
                f"compute_threads: expected a positive number of threads or None (torch's setting), got {count!r}"
            )
        self._compute_threads = count

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the wrapped optimizer's parameters.

        Args:
            set_to_none: Set them to None rather than to zero.
        """
        self.optimizer.zero_grad(set_to_none)

    # -- stepping ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter with a gradient.

        With ``step_in_backward`` on, it steps the parameters whose chunk did not complete in backward and waits for
        the writes. If the step fails part way (a read fails, the wrapped optimizer raises), the parameters of the
        chunks already stepped keep their step and its state, the others are untouched with their state as before;
        the error carries a note listing both (positions in ``param_groups`` order). A failed write does not stop
        the step: every parameter is stepped, that state stays in memory, and the ``OSError`` is raised at the end.
        A Ctrl-C during the step takes effect once the whole step is done.

        Args:
            closure: Evaluated once first, with gradients enabled (the wrapped optimizer steps without it); None:
                none.

        Returns:
            The closure's result, or None without one.
        """
        check_no_step_hooks(self.optimizer)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self._busy:
            if self._backward is not None:
                with deferred():
                    self._backward.finish()
                return loss
            with deferred(), intra_op_threads(self._compute_threads):  # Ctrl-C: once the whole step is done
                try:
                    params = self.pipeline.params()  # (all at once when not per-parameter: the groups as they are)
                    chosen = [p for p in params if p.grad is not None] if self.per_parameter else params
                    chunks = self.pipeline.chunks(chosen)
                    self.pipeline.run(chunks, self.pipeline.step_chunk)
                    if self.read_ahead:
                        self.pipeline.read_ahead(chunks)
                finally:
                    self.pipeline.trim_step()
        return loss

    def step_in_backward(self, enabled: bool = True) -> None:
        """Opt-in overlap with the backward pass: each chunk of parameters steps inside ``backward()``.

        Chunks are planned in reverse order, as backward produces gradients; each steps as soon as all its gradients
        are accumulated, while the next chunks' state is read; the first chunks' state is read during the forward
        pass. ``step()`` then steps the parameters whose chunk did not complete (e.g. some got no gradient) and waits
        for the writes. Results are bit-identical to the plain optimizer (the ``in_backward`` cells of
        ``tests/swap/optimizer/test_optimizer_matrix.py``).

        Refused for parameters of a ``DistributedDataParallel`` model, whose gradients are averaged only as
        backward ends. Requires one ``backward()`` per ``step()`` and gradients used as backward leaves them: a
        second backward before ``step()`` (gradient accumulation) raises ``UnsupportedError`` in that backward.
        What each gradient held when its chunk completed (identity, data pointers, version, a digest of its bytes)
        is compared at ``step()``: any change (clipping, ``.data`` edits, ``p.grad = ...``, GradScaler's unscale)
        raises ``UnsupportedError``. The first step after turning it on only checks: backward steps nothing, and a
        change is refused before any parameter moves; later steps step in backward, and a change is refused after
        backward stepped with the gradients as it left them. So is a param group's setting changed after backward
        (``lr`` set between backward and ``step()``), or a parameter changed in place (not seen through ``.data``).
        A ``GradScaler`` is refused at its first ``scale()`` (before that backward). Use the default mode for those
        loops. Step pre-hooks run at ``step()``, after most
        parameters were stepped.

        Args:
            enabled: True turns it on (nothing changes when it is on already); False returns to stepping in
                ``step()``.

        Raises:
            UnsupportedError: A ``RuntimeError``, when turning it on for parameters a ``DistributedDataParallel``
                holds, or for an optimizer stepped over all parameters at once (``per_parameter=False``).
        """
        if enabled and self._backward is None:
            if not self.per_parameter:
                raise UnsupportedError(
                    f"OffloadedOptimizer.step_in_backward: this {type(self.optimizer).__name__} steps all "
                    f"parameters at once (per_parameter=False), which needs every gradient: it cannot step inside "
                    f"backward. Call step() after backward"
                )
            refuse_step_in_backward_under_ddp(self.pipeline.params())
            self.pipeline.drop_prefetched()  # (the default mode's read-ahead: backward reads in its own order)
            self._backward = BackwardSteps(self.pipeline, lambda: self._compute_threads)
        elif not enabled and self._backward is not None:
            self._backward.close()
            self._backward = None

    def prefetch(self, params: Iterable[torch.Tensor]) -> None:
        """Start reading the stored state of ``params`` in the chunks a ``step()`` over exactly them will use.

        That step (over those with a gradient then) waits only for what is still in flight. Steps over other
        parameters in between keep these reads for it (a block-by-block trainer reads the next block's state while
        this block steps); a step over any of their parameters in other chunks releases them (their state changes
        then), as do ``state_dict``, ``load_state_dict`` and ``close``. Costs staging buffers until then (see
        ``SwapConfig``).

        Args:
            params: The parameters a coming step will step (others of this optimizer's are ignored).
        """
        chosen, pipeline = set(params), self.pipeline
        for chunk in pipeline.chunks([p for p in pipeline.params() if p in chosen]):
            key = tuple(map(id, chunk))
            if key not in pipeline.prefetched:
                pipeline.prefetched[key] = pipeline.read(chunk)
            pipeline.asked.add(key)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` with the tensor state read back from storage.

        State-dict hooks registered on this wrapper run as torch's do. Called from another thread during ``step()``,
        it waits for the step and returns the state after it.

        Returns:
            The state dict (``state`` and ``param_groups``); its tensors are copies the caller owns, suitable for
            ``torch.save``.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        with self._busy:
            result = self._gather_state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            changed = post_hook(self, result)
            if changed is not None:
                result = changed
        return result

    def _gather_state_dict(self) -> dict[str, Any]:
        pipeline = self.pipeline
        pipeline.drop_prefetched()
        self.swapper.wait_all()
        result = self.optimizer.state_dict()
        state = {key: dict(values) for key, values in result["state"].items()}
        params = pipeline.params()
        index = {id(p): i for i, p in enumerate(params)}
        for p in params:  # state the user reset since it was stored
            if self.swapper.has(pipeline.name(p)) and not holds_stored(self.optimizer.state.get(p)):
                self.swapper.discard(pipeline.name(p))
                pipeline.strides.pop(pipeline.name(p), None)
        stored = [p for p in params if self.swapper.has(pipeline.name(p))]
        read_stored(pipeline.chunks(stored), pipeline.read, index, state, pipeline.strides)
        result["state"] = state
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict and move its tensor state to storage.

        Load-state-dict hooks registered on this wrapper run as torch's do. Called from another thread during
        ``step()``, it waits for the step first.

        Args:
            state_dict: A state dict from ``state_dict()`` of this class or of the plain optimizer.
        """
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            changed = hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        with self._busy:  # (another thread's step finishes first)
            pipeline = self.pipeline
            pipeline.drop_prefetched()
            self.swapper.wait_all()
            self.optimizer.load_state_dict(state_dict)
            for param in pipeline.params():
                self.swapper.discard(pipeline.name(param))
                pipeline.strides.pop(pipeline.name(param), None)
            pipeline.loading = True
            try:
                pipeline.swap_out_resident()
            finally:
                pipeline.loading = False
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- lifetime and figures ---------------------------------------------------------------------------------
    def stored_bytes(self) -> int:
        """Bytes of optimizer state held on storage now."""
        return self.swapper.stored_bytes()

    def _close_backward(self) -> None:
        if self._backward is not None:
            self._backward.close()
            self._backward = None

    def close(self) -> None:
        """Finish all IO and remove the swap files (unless ``keep_files``); the optimizer is unusable after."""
        with self._busy:  # (another thread's step finishes first)
            try:
                self._close_backward()
                self.pipeline.drop_prefetched()
            finally:
                self.swapper.close()

    def __enter__(self) -> "OffloadedOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "OffloadedOptimizer cannot be pickled, copied or deep-copied (torch.save(opt) included): "
            "its tensor state lives in swap files this object owns. Save opt.state_dict() (the real "
            "state, read from storage) and load it with load_state_dict() into a new OffloadedOptimizer"
        )

    def __repr__(self) -> str:
        return f"OffloadedOptimizer({self.optimizer!r}, folder={self.swapper.folder!r})"
