"""How ``OffloadedOptimizer`` steps: chunk by chunk, its state read from and written to storage around each chunk.

``_ChunkSteps`` is the chunk pipeline ``OffloadedOptimizer`` inherits: chunk k+1.. is read and chunk k-1 written
while chunk k steps, each chunk's state restored into the wrapped optimizer before its step and stored after it, an
interrupted step noted on its error, and freed heap pages returned to the system along the way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Any, Callable

import torch

from ..io.handle import wait_each
from .chunk_plan import _Chunk, index_ranges
from .optimizer_state import _storable, restore, write_back, write_copy
from .pool import trim_heap
from .tensor_swapper import SwapIn, SwapOut

if TYPE_CHECKING:
    from .chunk_plan import ChunkPlanner
    from .config import SwapConfig
    from .tensor_swapper import TensorSwapper


class _ChunkSteps:
    """``OffloadedOptimizer``'s chunk pipeline; the attributes below are set by ``OffloadedOptimizer.__init__``."""

    optimizer: torch.optim.Optimizer
    config: SwapConfig
    swapper: TensorSwapper
    param_groups: list[dict[str, Any]]
    _inner_step: Callable[[], Any]
    _names: dict[int, str]
    _strides: dict[str, dict[str, tuple[int, ...]]]
    _prefetched: dict[tuple[int, ...], SwapIn]
    _planner: ChunkPlanner
    _copied: bool
    _loading: bool
    _trimmed_at: int

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _note_stopped(self, error: BaseException, chunks: list[_Chunk], stepped: int, failed_inside: bool) -> None:
        """Say on ``error`` which parameters the interrupted step changed and which it did not."""
        position = {id(p): i for i, p in enumerate(self._params())}
        done = sorted(position[id(p)] for chunk in chunks[:stepped] for p in chunk)
        rest = sorted(position[id(p)] for chunk in chunks[stepped:] for p in chunk)
        note = (
            f"OffloadedOptimizer.step stopped: parameters {index_ranges(done)} (positions in param_groups order) "
            f"were fully stepped, their state stored or kept in memory; parameters {index_ranges(rest)} were not "
            f"stepped and their state is as before the step"
        )
        if failed_inside:
            failing = sorted(position[id(p)] for p in chunks[stepped])
            note += (
                f" (the wrapped optimizer raised while stepping {index_ranges(failing)}: they are as it left "
                f"them; torch's optimizers check their inputs before changing anything)"
            )
        if hasattr(error, "add_note"):
            error.add_note(note)

    def _drop_prefetched(self, keep: AbstractSet[tuple[int, ...]] = frozenset()) -> dict[tuple[int, ...], SwapIn]:
        """Release the prefetched reads not in ``keep``.

        Returns:
            The others (which this optimizer forgets).
        """
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

    def _chunks(self, params: list[torch.Tensor]) -> list[_Chunk]:
        """The chunks a pass over ``params`` steps in (see ``ChunkPlanner.plan``)."""
        return self._planner.plan(params)

    def _run(self, chunks: list[_Chunk], action: Callable[[_Chunk], None] | None) -> None:
        """Read chunks k+1.. and write chunk k-1 while ``action`` runs on chunk k; return once every write is done.

        A failed write does not stop the step: its state stays in memory and the first such error is raised at the
        end. A failed read stops it (that chunk cannot step). Transfers in flight always finish first when it stops.
        """
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
                    early = prefetched.pop(tuple(map(id, following)), None)
                    reads.append(early or self._read(following))
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
        """Return freed heap pages to the system (``trim_heap``, which costs milliseconds) when it is worth it.

        That is once state that lived in ordinary memory was stored and freed, or half of ``chunk_bytes`` of state
        was read since the last time. Freeing such state raises glibc's mmap threshold, after which the step's
        temporaries come from the heap; without this the heap keeps growing through the step (measured: 1 GB of Adam
        state, 30-40 MB more peak).
        """
        read = self.swapper.bytes_read
        if self._copied or read - self._trimmed_at >= self.config.chunk_bytes // 2:
            self._copied, self._trimmed_at = False, read
            trim_heap()

    def _read(self, chunk: _Chunk) -> SwapIn:
        has = self.swapper.has
        return self.swapper.swap_in([name for name in chunk.names if has(name)])

    def _restore(self, chunk: _Chunk, read: SwapIn) -> None:
        """Put a chunk's state, read from storage, into the wrapped optimizer's state."""
        restore(self.optimizer, chunk, read)

    def _write(self, chunk: _Chunk, staged: SwapIn) -> SwapOut:
        """Store a chunk's state after its step.

        The read's buffer is written back as it is where nothing but its values changed, the state copied out
        otherwise.

        Returns:
            The write in flight.
        """
        write = write_back(self.optimizer, self.swapper, chunk, staged)
        if write is not None:
            return write
        self._copied = True
        return write_copy(self.optimizer, self.swapper, chunk, staged, self._names, self._loading, self._strides)

    def _swap_out_resident(self) -> None:
        params = [p for p in self._params() if any(_storable(v) for v in self.optimizer.state.get(p, {}).values())]
        try:
            self._run(self._chunks(params), None)
        finally:
            self._trim()
