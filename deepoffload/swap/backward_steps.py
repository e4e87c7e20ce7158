"""``OffloadedOptimizer.step_in_backward``: each chunk of parameters steps inside ``backward()``.

A chunk steps as soon as its gradients are accumulated, while the next chunks' state is read. What each chunk's
gradients held when they were used is recorded (``grad_prints.GradPrint``), and ``step()`` compares it with what they
hold then: any change made after backward (in place, through ``.data``, by reassignment, by GradScaler's unscale)
is refused, and so is a change of the param groups' settings (``lr`` set after backward: ``grad_prints.GroupPrint``)
and of a parameter in place (its version; not through ``.data``, which has a version of its own).
The first step is a check: backward records the gradients without stepping, and ``step()`` refuses a
change before any parameter moves, or steps them all as the plain optimizer would. A ``GradScaler`` is refused at its
first ``scale()``, before that backward (``scaled_losses``).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import UnsupportedError
from .ddp import refuse_step_in_backward_under_ddp
from .grad_prints import GradPrint, GroupPrint
from .interrupts import deferred
from .optimizer_state import StoredState
from .scaled_losses import LossGraph, unwatch, watch
from .tensor_swapper import SwapOut
from .torch_optim import intra_op_threads

if TYPE_CHECKING:
    from .optimizer_pipeline import ChunkPipeline


def _on_grad(plan: weakref.ref, param: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: its plan's ``_on_grad``, while the plan lives."""
    steps = plan()
    if steps is not None:
        steps._on_grad(param)


def _remove(handles: list) -> None:
    """Remove a collected plan's hooks."""
    for handle in handles:
        handle.remove()


class BackwardSteps:
    """``step_in_backward``'s plan and progress.

    The chunks (reverse parameter order), which of their gradients are ready, what the gradients of each completed
    chunk held, which chunks stepped in this backward, and their writes. Until a ``step()`` has found the gradients
    as backward left them (``checked``), backward only records them.

    Args:
        pipeline: The optimizer's chunk pipeline (its parameters, chunks, reads, steps and writes).
        threads: The optimizer's ``compute_threads`` now (torch intra-op threads while a chunk steps; None: torch's).
    """

    def __init__(self, pipeline: ChunkPipeline, threads: Callable[[], int | None]):
        self.pipeline = pipeline
        self.threads = threads
        self.ready: list[set[int]] = []
        self.checked = False  # a step() found the gradients of every completed chunk as backward left them
        self.prints: dict[int, GradPrint] = {}  # id(param) -> its gradient when its chunk completed in backward
        self.settings: GroupPrint | None = None  # the param groups' settings when the first chunk completed
        self.marks: dict[int, tuple[int, int]] = {}  # id(param) -> its data pointer and version once its chunk is done
        self.stepped: set[int] = set()  # id(param) of those stepped inside backward
        self.entries: dict[int, Any] = {}  # id(param) -> its state entry once stepped (to see a reset before step())
        self.writes: list[SwapOut] = []
        self.error: OSError | None = None
        # The hooks reach this plan through a weak reference: a parameter's hooks live as long as the parameter (held
        # from C++, which the cycle collector does not see), and a strong one would keep an optimizer dropped without
        # close() stepping in every later backward, and refusing every GradScaler in the process.
        hook = functools.partial(_on_grad, weakref.ref(self))
        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in pipeline.params() if p.requires_grad]
        weakref.finalize(self, _remove, self.handles)
        self._plan()
        watch(self)

    def scaled_loss_error(self, graph: LossGraph) -> UnsupportedError | None:
        """The refusal of a ``GradScaler``'s scaled loss while this plan is on (see ``scaled_losses``).

        Args:
            graph: The scaled loss's graph.

        Returns:
            The error naming what works instead, or None when the loss reaches none of this optimizer's parameters.
        """
        if not graph.reaches(p for p in self.pipeline.params() if p.requires_grad):
            return None
        return UnsupportedError(
            "OffloadedOptimizer.step_in_backward: a GradScaler scales this loss, but each chunk would step "
            "inside backward with the scaled gradients, before scaler.step() can unscale them or skip an "
            "overflowing step; nothing was stepped. Turn it off (opt.step_in_backward(False)) and use "
            "scaler.scale(loss).backward(); scaler.step(opt); scaler.update() as in memory (exact)"
        )

    def _plan(self) -> None:
        """Chunks for the coming backward, and their first ones' state read now (during the forward)."""
        opt = self.pipeline
        self.chunks = opt.chunks([p for p in reversed(opt.params()) if p.requires_grad])
        self.index = {id(p): k for k, chunk in enumerate(self.chunks) for p in chunk}
        self.ready = [set() for _ in self.chunks]
        self.next = 0  # reads are started for chunks from here on, in plan order
        self._read_ahead()

    def _read_ahead(self, wait: bool = True) -> None:
        """Start the reads of the coming chunks, up to ``buffer_count - 2`` in flight.

        Unless ``wait``, only while a staging buffer is free (no waiting for a write to free one).
        """
        opt = self.pipeline
        ahead = max(1, opt.config.buffer_count - 2)
        while self.next < len(self.chunks) and len(opt.prefetched) < ahead and (wait or opt.swapper.pool.available()):
            chunk = self.chunks[self.next]
            self.next += 1
            if len(self.ready[self.next - 1]) < len(chunk):
                opt.prefetched[tuple(map(id, chunk))] = opt.read(chunk)

    def _on_grad(self, param: torch.Tensor) -> None:
        if id(param) in self.prints:
            done = (
                f"the first backward already stepped {len(self.stepped)} parameter(s) with its gradients alone"
                if self.stepped
                else "nothing was stepped"
            )
            raise UnsupportedError(
                f"OffloadedOptimizer.step_in_backward: a second backward() before step() (gradient "
                f"accumulation, or a step skipped?); each parameter steps with the gradient of one backward: "
                f"{done}. Turn it off (opt.step_in_backward(False)), which accumulates exactly as in memory, or "
                f"call step() after every backward (turn it off and on again to start over)"
            )
        k = self.index.get(id(param))
        if k is None:
            return
        self.ready[k].add(id(param))
        if len(self.ready[k]) == len(self.chunks[k]):
            chunk = self.chunks[k]
            with torch.no_grad():
                for p in chunk:
                    grad = p.grad
                    if grad is not None and grad.layout != torch.strided:
                        raise UnsupportedError(
                            f"OffloadedOptimizer.step_in_backward: a {grad.layout} gradient cannot be checked for "
                            f"changes after backward; use opt.step_in_backward(False) for sparse gradients"
                        )
                    if grad is not None:
                        self.prints[id(p)] = GradPrint(grad)
            if self.settings is None:
                self.settings = GroupPrint(self.pipeline.param_groups, self.pipeline.optimizer.defaults)
            try:
                if self.checked:
                    with deferred(), torch.no_grad(), intra_op_threads(self.threads()):
                        self._step(k)  # (a Ctrl-C is raised once the chunk is stepped: it then ends the backward)
            finally:  # (stepped or not) an in-place change from here on would come in the wrong order
                for p in chunk:
                    self.marks[id(p)] = (p.data_ptr(), p._version)

    def _step(self, k: int) -> None:
        opt, chunk = self.pipeline, self.chunks[k]
        read = opt.prefetched.pop(tuple(map(id, chunk)), None) or opt.read(chunk)
        applied = False
        try:
            # The next chunks' reads go first: they start during this chunk's compute, queued before its write (one
            # IO thread serves requests in order, and the next chunk waits for its read, not for a write).
            self._collect_done()
            self.next = max(self.next, k + 1)
            self._read_ahead(wait=False)
            opt.restore(chunk, read)
            applied = True
            opt.step_chunk(chunk)
            self.writes.append(opt.write(chunk, read))
        except BaseException:
            if applied:
                read.detach()  # the state is in use (in memory): its buffer leaves the pool
            else:
                read.release()
            raise
        opt.trim(grew=sum(p.grad.nbytes for p in chunk if p.grad is not None))  # the backward made these since
        for p in chunk:
            self.stepped.add(id(p))
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
        """``step()``: check the gradients backward used are unchanged, step what is left, wait for the writes.

        On the first step (``checked`` false) backward stepped nothing: a change refuses the step before any
        parameter moves, else every parameter with a gradient steps here. Then plan the next backward (also when
        it fails). A failed write is raised (its ``OSError``) after all of that.

        Raises:
            UnsupportedError: When gradients changed after backward (clipping, unscaling, ``.data`` edits,
                reassignment, ``zero_grad`` before ``step``, or a DDP built after ``step_in_backward()``), or state
                was reset after backward stepped with it, a param group's setting (``lr``, ...) changed after
                backward, or a parameter was changed in place (its version) or replaced after backward.
        """
        opt = self.pipeline
        prints = self.prints
        changed = [(p, how) for p in opt.params() if id(p) in prints and (how := prints[id(p)].changed(p.grad))]
        try:
            if changed:
                refuse_step_in_backward_under_ddp([p for p, _ in changed])  # a DDP built after step_in_backward()
                if not self.stepped:
                    done = "nothing was stepped"
                else:
                    done = "the parameters backward stepped took their step with the gradients as backward left them"
                raise UnsupportedError(
                    f"OffloadedOptimizer.step_in_backward: the gradients of {len(changed)} parameter(s) changed "
                    f"between backward and step() (the first {changed[0][1]}: gradient clipping, GradScaler "
                    f"unscaling, .data edits, p.grad = ..., zero_grad before step?); {done}. Turn it off "
                    f"(opt.step_in_backward(False)) to change gradients before step(): that steps exactly as in "
                    f"memory"
                )
            setting = self.settings.changed(opt.param_groups) if self.settings is not None else None
            if setting is not None:
                raise UnsupportedError(
                    f"OffloadedOptimizer.step_in_backward: the {setting} changed between backward and step() (a "
                    f"learning rate set after backward, an LR scheduler stepped before opt.step()?); "
                    f"{'nothing was stepped' if not self.stepped else 'backward stepped with the setting before'}. "
                    f"Change settings before backward (after opt.step()), or turn it off "
                    f"(opt.step_in_backward(False)), which steps exactly as in memory"
                )
            marks = self.marks
            edited = [p for p in opt.params() if id(p) in marks and marks[id(p)] != (p.data_ptr(), p._version)]
            if edited:
                raise UnsupportedError(
                    f"OffloadedOptimizer.step_in_backward: {len(edited)} parameter(s) were changed in place or "
                    f"replaced between backward and step() (clamped, projected, copied into?); "
                    f"{'nothing was stepped' if not self.stepped else 'backward stepped them before that change'}. "
                    f"Change parameters after opt.step(), or turn it off (opt.step_in_backward(False)), which steps "
                    f"exactly as in memory"
                )
            state, entries = opt.optimizer.state, self.entries
            reset = [
                p
                for p in opt.params()
                if id(p) in entries
                and (
                    state.get(p) is not entries[id(p)]
                    or (type(entries[id(p)]) is StoredState and entries[id(p)].cleared)
                )
            ]
            if reset:
                raise UnsupportedError(
                    f"OffloadedOptimizer.step_in_backward: the state of {len(reset)} parameter(s) "
                    f"was reset (opt.state replaced or cleared, an entry deleted, replaced or "
                    f"cleared) after backward stepped them with the state before; the reset applies "
                    f"from the next step. Reset state before backward, or turn step_in_backward off"
                )
            rest = [p for p in opt.params() if p.grad is not None and id(p) not in self.stepped]
            with intra_op_threads(self.threads()):
                opt.run(opt.chunks(rest), opt.step_chunk)
            self.checked = True
        finally:
            for write in self.writes:
                self._collect(write)
            opt.trim_step()
            self.writes, self.stepped, self.entries, self.prints, self.settings = [], set(), {}, {}, None
            self.marks = {}
            error, self.error = self.error, None
            opt.drop_prefetched()
            self._plan()
        if error is not None:
            raise error

    def close(self) -> None:
        """Remove the hooks, collect the writes in flight and release the reads started early.

        Raises:
            OSError: The first write that failed and was not raised yet.
        """
        unwatch(self)
        for handle in self.handles:
            handle.remove()
        for write in self.writes:
            self._collect(write)
        self.writes = []
        self.pipeline.drop_prefetched()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
