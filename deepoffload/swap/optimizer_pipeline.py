"""How ``OffloadedOptimizer`` steps: chunk by chunk, its state read from and written to storage around each chunk.

``ChunkPipeline`` is the chunk pipeline an ``OffloadedOptimizer`` holds: chunk k+1.. is read and chunk k-1 written
while chunk k steps, each chunk's state restored into the wrapped optimizer before its step and stored after it, an
interrupted step noted on its error, and freed heap pages returned to the system along the way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Any, Callable

import torch

from ..io.handle import wait_each
from .adam_slices import SLICE_ELEMENTS, adam_slices
from .chunk_plan import ChunkPlanner, index_ranges
from .chunks import Chunk
from .optimizer_state import restore, storable, write_back, write_copy
from .pool import resident_bytes, trim_heap
from .tensor_swapper import SwapIn, SwapOut

if TYPE_CHECKING:
    from .config import SwapConfig
    from .tensor_swapper import TensorSwapper


class ChunkPipeline:
    """An ``OffloadedOptimizer``'s steps over chunks of parameters, their state read, stepped and written back.

    Args:
        optimizer: The wrapped optimizer.
        inner_step: Its own ``step`` without its hooks (called once per chunk, its param groups restricted).
        swapper: Where the state lives (packed).
        config: The swap settings (``buffer_count``, ``chunk_bytes``).
        per_parameter: Whether the optimizer steps in chunks (else once over all parameters).

    Attributes:
        names: ``id(param)`` -> its group name in the swapper (params stay alive in the param groups).
        strides: group name -> key -> strides of state that was not contiguous.
        prefetched: chunk (ids of its params) -> its read, started early.
        asked: the chunks of ``prefetched`` that ``OffloadedOptimizer.prefetch`` asked for: kept for their own step
            while steps over other chunks run (a block-by-block trainer reads the next block's state during this one's).
        loading: ``load_state_dict`` is storing the loaded state.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        inner_step: Callable[[], Any],
        swapper: TensorSwapper,
        config: SwapConfig,
        per_parameter: bool,
    ):
        self.optimizer = optimizer
        self.inner_step = inner_step
        self.swapper = swapper
        self.config = config
        self.per_parameter = per_parameter
        self.names: dict[int, str] = {}
        self.strides: dict[str, dict[str, tuple[int, ...]]] = {}
        self.prefetched: dict[tuple[int, ...], SwapIn] = {}
        self.asked: set[tuple[int, ...]] = set()
        self.loading = False
        self._planner = ChunkPlanner(self)
        self.slice_elements: int | None = SLICE_ELEMENTS  # torch's Adam steps larger parameters in slices (None: whole)
        self._copied = False  # state held in ordinary memory was stored since the heap was last trimmed
        self._mark: int | None = None  # the resident memory at the first look after the last trim
        self._read_at = 0  # swapper.bytes_read at the last trim (where the resident memory cannot be read)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups."""
        return self.optimizer.param_groups

    def params(self) -> list[torch.Tensor]:
        """Every parameter, in param-groups order.

        Returns:
            The parameters.
        """
        return [p for group in self.param_groups for p in group["params"]]

    def name(self, param: torch.Tensor) -> str:
        """The swapper's group name of ``param``'s state (given on first use).

        Args:
            param: The parameter.

        Returns:
            ``param<N>``.
        """
        name = self.names.get(id(param))
        if name is None:
            name = self.names[id(param)] = f"param{len(self.names)}"
        return name

    def note_stopped(self, error: BaseException, chunks: list[Chunk], stepped: int, failed_inside: bool) -> None:
        """Say on ``error`` which parameters the interrupted step changed and which it did not."""
        position = {id(p): i for i, p in enumerate(self.params())}
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

    def drop_prefetched(self, keep: AbstractSet[tuple[int, ...]] = frozenset()) -> dict[tuple[int, ...], SwapIn]:
        """Release the prefetched reads not in ``keep``.

        Returns:
            The others (which this optimizer forgets).
        """
        kept, prefetched, self.prefetched = {}, self.prefetched, {}
        for key, read in prefetched.items():
            if key in keep:
                kept[key] = read
            else:
                read.release()
        self.asked.intersection_update(kept)
        return kept

    def step_chunk(self, chunk: Chunk) -> None:
        """Run the wrapped optimizer's step over ``chunk``'s parameters only (its state restored already).

        Args:
            chunk: The chunk.
        """
        groups = self.param_groups
        saved = [group["params"] for group in groups]
        if chunk.in_groups is None or len(chunk.in_groups) != len(groups):
            chosen = set(map(id, chunk))
            chunk.in_groups = [[p for p in params if id(p) in chosen] for params in saved]
        try:
            with adam_slices(self.optimizer, chunk.in_groups, self.slice_elements or 0) as in_groups:
                for group, params in zip(groups, in_groups):
                    group["params"] = params
                self.inner_step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    def chunks(self, params: list[torch.Tensor]) -> list[Chunk]:
        """The chunks a pass over ``params`` steps in (see ``ChunkPlanner.plan``).

        Args:
            params: The parameters, in order.

        Returns:
            The chunks.
        """
        return self._planner.plan(params)

    def run(self, chunks: list[Chunk], action: Callable[[Chunk], None] | None) -> None:
        """Read chunks k+1.. and write chunk k-1 while ``action`` runs on chunk k; return once every write is done.

        A failed write does not stop the step: its state stays in memory and the first such error is raised at the
        end. A failed read stops it (that chunk cannot step). Transfers in flight always finish first when it stops.
        """
        writes: list[SwapOut] = []
        mine = {tuple(map(id, chunk)) for chunk in chunks}
        stepped_ids = {i for key in mine for i in key}
        # reads asked for a coming step over other parameters stay for it; one holding any parameter this step
        # changes would be stale: released
        prefetched = self.drop_prefetched(mine | {key for key in self.asked if stepped_ids.isdisjoint(key)})
        for key in [key for key in prefetched if key not in mine]:
            self.prefetched[key] = prefetched.pop(key)
        self.asked -= mine
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
                    reads.append(early or self.read(following))
                current = reads.pop(0)
                self.restore(chunk, current)
                if action is not None:
                    inside = True
                    action(chunk)
                    inside = False
                stepped = k + 1
                writes.append(self.write(chunk, current))
                current = None
                self.trim()
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
                self.note_stopped(e, chunks, stepped, inside)
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

    def read_ahead(self, chunks: list[Chunk]) -> None:
        """Start reading the first chunks' state for the next step over the same chunks, as a step just ended.

        The reads run during the next forward and backward, so the next ``run`` over these chunks starts stepping at
        once instead of waiting for its first chunk's read (and has that much less IO left to overlap). They use the
        pool's buffers (as many as a step keeps reading ahead), which exist already: no memory is added. A step over
        other chunks releases them (``drop_prefetched``), as do ``state_dict``, ``load_state_dict`` and ``close``.
        Only a head start: a read that cannot start is left to the next step, which reads, and reports, itself.

        Args:
            chunks: The chunks the step just ran over, in order.
        """
        window = max(1, self.config.buffer_count - 2) + 1  # what ``run`` keeps in flight beyond the chunk stepping
        try:
            for chunk in chunks[:window]:
                key = tuple(map(id, chunk))
                if key not in self.prefetched:
                    self.prefetched[key] = self.read(chunk)
        except OSError:
            self.drop_prefetched()

    def trim(self, grew: int = 0) -> None:
        """Return freed heap pages to the system (``trim_heap``) after a chunk, where it is worth it.

        - State that lived in ordinary memory (made by the wrapped optimizer in memory, or loaded) was stored: it is
          freed as its chunk is written and, after glibc raised its mmap threshold, stays in the heap as free memory
          that nothing reuses. Trimmed at once.
        - Otherwise only once the resident memory grew a staging buffer's bytes above where it was at the first chunk
          after the last trim. Each chunk's temporaries mostly reuse the heap pages the previous chunk's left, so
          they are kept: trimming them made every chunk fault them in again (1.07 GB of Adam state trimmed every half
          chunk: a gigabyte of page faults and 0.5 s of system time a step). The heap swings by about two of them
          from chunk to chunk (glibc does not always fit them into the same free block), and a buffer holds a
          parameter's state (two moments of its size), so a swing never trims; growth past it is returned, and
          ``trim_step`` returns the rest as the step ends.
        Where the resident memory cannot be read, the heap is trimmed every buffer's bytes of state read.

        Args:
            grew: Bytes the caller's own tensors took since the last chunk (``step_in_backward``: the gradients the
                backward made), which are not the heap's growth.
        """
        if self._copied:
            self.trim_step()
            return
        allowance = self.swapper.pool.buffer_bytes
        resident = resident_bytes()
        if resident is None:
            if self.swapper.bytes_read - self._read_at >= allowance:
                self.trim_step()
        elif self._mark is None:  # the first look after a trim: the chunk's temporaries are faulted in again
            self._mark = resident
        else:
            self._mark += grew
            if resident - self._mark >= allowance:
                self.trim_step()

    def trim_step(self) -> None:
        """Return all freed heap pages to the system now (``trim_heap``): as a step ends, or when ``trim`` decides."""
        self._copied, self._mark, self._read_at = False, None, self.swapper.bytes_read
        trim_heap()

    def read(self, chunk: Chunk) -> SwapIn:
        """Start reading the stored state of ``chunk``'s parameters.

        Args:
            chunk: The chunk.

        Returns:
            The read in flight.
        """
        has = self.swapper.has
        return self.swapper.swap_in([name for name in chunk.names if has(name)])

    def restore(self, chunk: Chunk, read: SwapIn) -> None:
        """Put a chunk's state, read from storage, into the wrapped optimizer's state.

        Args:
            chunk: The chunk.
            read: Its state's read.
        """
        restore(self.optimizer, chunk, read)

    def write(self, chunk: Chunk, staged: SwapIn) -> SwapOut:
        """Store a chunk's state after its step.

        The read's buffer is written back as it is where nothing but its values changed, the state copied out
        otherwise.

        Args:
            chunk: The chunk.
            staged: The read its state came from.

        Returns:
            The write in flight.
        """
        write = write_back(self.optimizer, self.swapper, chunk, staged)
        if write is not None:
            return write
        self._copied = True
        return write_copy(self.optimizer, self.swapper, chunk, staged, self.names, self.loading, self.strides)

    def swap_out_resident(self) -> None:
        """Store the tensor state the wrapped optimizer holds in memory (e.g. made in its ``__init__``)."""
        params = [p for p in self.params() if any(storable(v) for v in self.optimizer.state.get(p, {}).values())]
        try:
            self.run(self.chunks(params), None)
        finally:
            self.trim()
