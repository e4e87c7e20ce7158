"""How much memory ``offload_parameters`` holds, and the settings that keep a process within a limit.

``MemoryPlan`` counts the memory part by part; ``fit`` (behind ``max_memory=``) chooses the settings.

All figures are bytes. The process's own memory (the interpreter, torch and what the caller holds: measured at the
call, see ``process_bytes``) and the activations of the user's forward and backward come on top of a plan's
``peak_bytes``; ``fit`` counts the first and leaves ``forward_bytes`` for the second.

The parts (B = the largest block's staging span, R = the bytes of parameters and buffers outside blocks, L = the
bytes of the largest block's parameters laid out other than row-major, which a read copies into their own layout):

- setup (building on meta and loading a checkpoint): R + the checkpoint reader's buffers (``READER_BYTES``) + 3 B
  (the block being made; the previous one being written, with its staging copy);
- streaming: R + (prefetch + 2) B of staging buffers (the block computing, the prefetched ones, one written back)
  and (prefetch + 2) L for those blocks' layout copies (0 for row-major models), and with a codec other than
  ``none`` (prefetch + 2) S for their encoded bytes, read or written beside the staging buffer (S: the codec's
  ``max_stored_bytes`` of B);
- training adds: the gradients outside blocks (R), the blocks' optimizer state buffers (``state_chunks`` x B) and
  those of the optimizer of the parameters outside blocks (``STATE_CHUNKS`` x min(B, R)), and
  ``TRAINING_BLOCKS`` x B for a block's gradients, its compute copy and the optimizer's temporaries;
- blocks kept in memory by ``max_resident_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import MemoryBudgetError
from ..memory import limit_with_room, parse_bytes, process_bytes  # noqa: F401  (re-exported: max_memory= parses here)

READER_SPAN_BYTES = 16 << 20  # the checkpoint reader's buffer per request while loading
READER_INFLIGHT_BYTES = 32 << 20  # and what it keeps in flight
READER_BYTES = READER_SPAN_BYTES + READER_INFLIGHT_BYTES
SETUP_BLOCKS = 3  # blocks in memory while loading: one made, and one written with its staging copy
STATE_CHUNKS = 6  # default optimizer staging buffers (block spans): a block's state read ahead and one being written
MIN_STATE_CHUNKS = 3  # the least the optimizer's pipeline works with: read ahead, step, write behind
TRAINING_BLOCKS = 3  # a block's gradients, its compute copy or Adam's temporaries, one more for the next block
INFERENCE_BLOCKS = 1  # a block's outputs and temporaries while it computes (at most its size for these models)
FORWARD_BYTES = 64 << 20  # left by ``fit`` for the activations of the user's forward when not told otherwise


@dataclass(frozen=True)
class MemoryPlan:
    """What ``offload_parameters`` holds at most (bytes), from the sizes of the model and the settings."""

    block_bytes: int  # the largest block's staging span
    rest_bytes: int  # parameters and buffers outside blocks (always in memory)
    prefetch: int = 1
    training: bool = False
    state_chunks: int = STATE_CHUNKS
    resident_bytes: int | None = 0  # blocks kept in memory (max_resident_bytes); None: to be fitted
    reader_bytes: int = READER_BYTES  # 0 without a checkpoint
    layout_bytes: int = 0  # the largest block's parameters not row-major (L): copied into their layout when read
    stored_bytes: int = 0  # the largest block's encoded bytes at most (S; 0 for codec none): beside its staging

    @property
    def setup_bytes(self) -> int:
        """The most held while building on meta and loading a checkpoint: R + the reader's buffers + 3 B."""
        return self.rest_bytes + self.reader_bytes + SETUP_BLOCKS * self.block_bytes

    @property
    def staging_bytes(self) -> int:
        """Staging buffers while streaming, with layout copies and encoded bytes: (prefetch + 2) (B + L + S)."""
        return (self.prefetch + 2) * (self.block_bytes + self.layout_bytes + self.stored_bytes)

    @property
    def _staged(self) -> str:
        """What one block in flight holds, as printed: B, (B + L), (B + S) or (B + L + S)."""
        parts = "B" + (" + L" if self.layout_bytes else "") + (" + S" if self.stored_bytes else "")
        return f"({parts})" if "+" in parts else parts

    @property
    def rest_chunk_bytes(self) -> int:
        """The size of one staging buffer of the optimizer of the parameters outside blocks."""
        return min(self.block_bytes, max(self.rest_bytes, 1))

    @property
    def optimizer_bytes(self) -> int:
        """The optimizers' state staging buffers when training (0 for inference)."""
        if not self.training:
            return 0
        return self.state_chunks * self.block_bytes + STATE_CHUNKS * self.rest_chunk_bytes

    @property
    def working_bytes(self) -> int:
        """A block's gradients and temporaries while it computes and steps."""
        return (TRAINING_BLOCKS if self.training else INFERENCE_BLOCKS) * self.block_bytes

    @property
    def run_bytes(self) -> int:
        """The most held while running: R (twice when training) + staging + optimizer + working + kept blocks."""
        rest = self.rest_bytes * (2 if self.training else 1)
        return rest + self.staging_bytes + self.optimizer_bytes + self.working_bytes + (self.resident_bytes or 0)

    @property
    def peak_bytes(self) -> int:
        """The most the library holds at once, setup or running (the process and the user's forward excluded)."""
        return max(self.setup_bytes, self.run_bytes)

    def parts(self) -> list[tuple[str, int]]:
        """(what, bytes) for printing."""
        rows = [
            ("largest block (B)", self.block_bytes),
            *([("its parameters not row-major (L)", self.layout_bytes)] if self.layout_bytes else []),
            ("outside blocks (R)", self.rest_bytes),
            (f"setup: R + reader + {SETUP_BLOCKS} B", self.setup_bytes),
            (
                f"staging: (prefetch {self.prefetch} + 2) {self._staged}",
                self.staging_bytes,
            ),
        ]
        if self.training:
            rows.append(
                (f"optimizer state buffers: {self.state_chunks} B + {STATE_CHUNKS} x min(B, R)", self.optimizer_bytes)
            )
        rows += [
            (
                "working: "
                + (
                    f"{TRAINING_BLOCKS} B (gradients, temporaries)"
                    if self.training
                    else f"{INFERENCE_BLOCKS} B (outputs, temporaries)"
                ),
                self.working_bytes,
            ),
            ("kept in memory (max_resident_bytes)", self.resident_bytes or 0),
            (
                "running: " + ("2 R" if self.training else "R") + " + staging + optimizer + working + kept",
                self.run_bytes,
            ),
            ("peak (max of setup and running)", self.peak_bytes),
        ]
        return rows


@dataclass(frozen=True)
class Fitted:
    """The settings ``fit`` chose for a limit, and the plan they give."""

    plan: MemoryPlan
    limit_bytes: int
    process_bytes: int
    forward_bytes: int

    @property
    def expected_peak_bytes(self) -> int:
        """The process's memory at its peak: the process now, the plan's peak and the forward's activations."""
        return self.process_bytes + self.plan.peak_bytes + self.forward_bytes


def fit(
    plan: MemoryPlan, limit: int, process: int, forward: int = FORWARD_BYTES, prefetch: int | None = None
) -> Fitted:
    """The settings that keep ``process + plan.peak_bytes + forward`` within ``limit`` bytes.

    The plan chosen has the most prefetch (up to ``prefetch``, default the plan's) and optimizer buffers, and then the
    most bytes of blocks kept in memory (up to ``plan.resident_bytes``; None: as many as fit, less a tenth of the
    limit kept free).

    Args:
        plan: The plan of the model's sizes and the settings wanted.
        limit: The limit, in bytes.
        process: The process's memory now, in bytes.
        forward: The bytes left for the activations of the user's forward.
        prefetch: The most prefetch (default: the plan's).

    Returns:
        The settings chosen and the plan they give.

    Raises:
        MemoryBudgetError: When even the least plan (prefetch 0, the fewest optimizer buffers, nothing kept) does
            not fit: the message gives the least limit that works and what it is made of.
    """
    want = plan.prefetch if prefetch is None else prefetch
    room = limit - process - forward
    least = replace(plan, prefetch=0, state_chunks=MIN_STATE_CHUNKS, resident_bytes=0)
    if least.peak_bytes > room:
        need = process + least.peak_bytes + forward
        parts = "; ".join(f"{what} {nbytes / 1e6:.1f} MB" for what, nbytes in least.parts())
        raise MemoryBudgetError(
            f"max_memory={limit} bytes ({limit / 1e6:.1f} MB) cannot hold this model: the least that "
            f"works is {need} bytes ({need / 1e6:.1f} MB): the process now {process / 1e6:.1f} MB + "
            f"the offload's own {least.peak_bytes / 1e6:.1f} MB ({parts}) + {forward / 1e6:.1f} MB "
            f"for the forward's activations. Raise max_memory (the process grows as it runs: "
            f"StreamOptions(max_memory={limit_with_room(need)!r}) leaves it room), or use smaller blocks (the largest "
            f"block is held {SETUP_BLOCKS}x while loading)"
        )
    chosen = least
    for chunks in range(MIN_STATE_CHUNKS, STATE_CHUNKS + 1):
        for depth in range(0, want + 1):
            candidate = replace(plan, prefetch=depth, state_chunks=chunks, resident_bytes=0)
            if candidate.peak_bytes <= room:
                chosen = candidate
    spare = room - chosen.peak_bytes - limit // 10  # a tenth of the limit stays free: memory nobody counted
    resident = plan.resident_bytes if plan.resident_bytes is not None else spare
    chosen = replace(chosen, resident_bytes=max(0, min(resident, spare)))
    return Fitted(chosen, limit, process, forward)


def encoded_bytes(codec: str, block_bytes: int) -> int:
    """S: the most bytes ``codec`` stores a block span of ``block_bytes`` in (0 for a codec storing bytes as they are).

    Args:
        codec: ``SwapConfig.codec``.
        block_bytes: The largest block's staging span (B).

    Returns:
        The encoded bytes a read or write holds beside the staging buffer.
    """
    from ..codecs import codec_class

    kind = codec_class(codec)
    return 0 if kind.identity else kind().max_stored_bytes(block_bytes)
