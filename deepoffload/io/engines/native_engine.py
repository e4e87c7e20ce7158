"""``NativeEngine``: an engine of the native op (csrc/aio), as the registry knows it.

The op's C++ engine table and ``op_builder.async_io.ENGINES`` (which decides what is compiled in) name the same engines;
the tests check that the registry's native engines are exactly those, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..native import compiled_engines, native, self_test
from .registry import Backend


@dataclass(frozen=True)
class NativeEngine:
    """One engine of the native op: the IO runs on the op's threads, without the GIL.

    Attributes:
        name: The engine's name in the native op.
        description: One line for the report: what the engine is and what it needs.
        native: Always True: its status needs the native op (built on first use).
    """

    name: str
    description: str
    native: bool = True

    def status(self) -> tuple[bool, str]:
        """(usable, why not): compiled into this build of the op, and its self-test passes here.

        Returns:
            The status; loads (and on first use builds) the native op.
        """
        compiled = compiled_engines()
        if self.name not in compiled:
            return False, (
                f"not in this build (compiled in: {', '.join(compiled)}); install its library and rebuild "
                f"(see `deepoffload report`)"
            )
        return self_test(self.name)

    def open(
        self, *, block_size: int, queue_depth: int, single_submit: bool, overlap_events: bool, intra_op_parallelism: int
    ) -> Backend:
        """The native op's ``Handle`` for this engine.

        Args:
            block_size: Bytes per IO request.
            queue_depth: Requests in flight per thread.
            single_submit: Submit one request per system call.
            overlap_events: Refill the queue as completions arrive.
            intra_op_parallelism: Threads that share one transfer.

        Returns:
            The handle (its methods are the ``Backend`` protocol's).
        """
        return native().Handle(self.name, block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
