"""``OffloadedOptimizer.step_in_backward``: each chunk of parameters steps inside ``backward()``.

A chunk steps as soon as its gradients are accumulated, while the next chunks' state is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import UnsupportedError
from .ddp import refuse_step_in_backward_under_ddp
from .interrupts import deferred
from .optimizer_state import _StoredState
from .tensor_swapper import SwapOut
from .torch_optim import _intra_op_threads

if TYPE_CHECKING:
    from .optimizer import OffloadedOptimizer


class _BackwardSteps:
    """``step_in_backward``'s plan and progress.

    The chunks (reverse parameter order), which of their gradients are ready, which chunks stepped in this backward,
    and their writes.
    """

    def __init__(self, optimizer: OffloadedOptimizer):
        self.optimizer = optimizer
        self.ready: list[set[int]] = []
        self.stepped: dict[int, int] = {}  # id(param) -> its gradient's version when it was stepped
        self.entries: dict[int, Any] = {}  # id(param) -> its state entry once stepped (to see a reset before step())
        self.writes: list[SwapOut] = []
        self.error: OSError | None = None
        self.handles = [
            p.register_post_accumulate_grad_hook(self._on_grad) for p in optimizer._params() if p.requires_grad
        ]
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
        """Start the reads of the coming chunks, up to ``buffer_count - 2`` in flight.

        Unless ``wait``, only while a staging buffer is free (no waiting for a write to free one).
        """
        opt = self.optimizer
        ahead = max(1, opt.config.buffer_count - 2)
        while self.next < len(self.chunks) and len(opt._prefetched) < ahead and (wait or opt.swapper.pool.available()):
            chunk = self.chunks[self.next]
            self.next += 1
            if len(self.ready[self.next - 1]) < len(chunk):
                opt._prefetched[tuple(map(id, chunk))] = opt._read(chunk)

    def _on_grad(self, param: torch.Tensor) -> None:
        if id(param) in self.stepped:
            raise UnsupportedError(
                "OffloadedOptimizer.step_in_backward: a second backward() before step() (gradient "
                "accumulation?); each parameter already stepped with the first backward's gradient. "
                "Call step() after every backward, or opt.step_in_backward(False)"
            )
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
        """``step()``: check the gradients used were not changed since, step what is left, wait for the writes.

        Then plan the next backward (also when it fails). A failed write is raised (its ``OSError``) after all of
        that.

        Raises:
            UnsupportedError: When gradients changed after backward stepped their parameters (clipping, unscaling,
                ``zero_grad`` before ``step``, or a DDP built after ``step_in_backward()``), or state was reset
                after backward stepped with it.
        """
        opt = self.optimizer
        changed = [
            p
            for p in opt._params()
            if id(p) in self.stepped and (p.grad is None or p.grad._version != self.stepped[id(p)])
        ]
        try:
            if changed:
                refuse_step_in_backward_under_ddp(changed)  # DDP built after step_in_backward() replaced them
                raise UnsupportedError(
                    f"OffloadedOptimizer.step_in_backward: the gradients of {len(changed)} "
                    f"parameter(s) changed after backward stepped them (gradient clipping, "
                    f"GradScaler unscaling, zero_grad before step?); those parameters took their "
                    f"step with the unchanged gradients. Turn step_in_backward off to clip or "
                    f"scale gradients"
                )
            state, entries = opt.optimizer.state, self.entries
            reset = [
                p
                for p in opt._params()
                if id(p) in entries
                and (
                    state.get(p) is not entries[id(p)]
                    or (type(entries[id(p)]) is _StoredState and entries[id(p)].cleared)
                )
            ]
            if reset:
                raise UnsupportedError(
                    f"OffloadedOptimizer.step_in_backward: the state of {len(reset)} parameter(s) "
                    f"was reset (opt.state replaced or cleared, an entry deleted, replaced or "
                    f"cleared) after backward stepped them with the state before; the reset applies "
                    f"from the next step. Reset state before backward, or turn step_in_backward off"
                )
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
