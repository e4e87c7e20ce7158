"""Type stub of the native async-IO module (csrc/aio/binding.cpp), built as ``deepoffload_aio``.

Raw pointers and sizes in, errno tuples out: ``deepoffload.io`` validates tensors and keeps their memory alive
until ``Handle.wait`` has returned their result. tests/native/test_binding_surface.py checks that these names are
exactly the built module's.
"""

from typing import Optional, TypedDict

TRUNCATE: int  # after a successful write, the file ends where the write (or a concurrent one) ends
BUFFERED: int  # do not use O_DIRECT
FSYNC: int  # fdatasync after a successful write

class _Defaults(TypedDict):
    engine: str
    block_size: int
    queue_depth: int
    single_submit: bool
    overlap_events: bool
    intra_op_parallelism: int

class _Features(TypedDict):
    engines: list[str]
    reap: str

DEFAULTS: _Defaults
"""The Handle's defaults, as C++ defines them (csrc/aio/engine.h, io_handle.h)."""

def engines() -> list[str]:
    """Compiled-in engines, best first; the last is the portable one."""

def build_features() -> _Features:
    """What this build contains: its engines (best first) and how libaio reaps completions."""

def self_test(engine: str, directory: str) -> tuple[bool, str]:
    """O_DIRECT write + read round trip of a temporary file in ``directory``: (ok, reason)."""

def dio_alignment(path: str) -> tuple[int, int, bool]:
    """(memory alignment, offset alignment, direct supported) in bytes for an existing file or directory.

    Raises OSError when the path is missing.
    """

# (errno, operation, path, offset, detail, direct); errno 0 means success.
_Result = tuple[int, str, str, int, str, bool]

class Handle:
    def __init__(
        self,
        engine: str = ...,
        block_size: int = ...,
        queue_depth: int = ...,
        single_submit: bool = ...,
        overlap_events: bool = ...,
        intra_op_parallelism: int = ...,
    ) -> None:
        """ValueError for a setting out of range, OSError (errno) when an engine or thread cannot start."""
    def submit(self, write: bool, ptr: int, nbytes: int, path: str, fd: int, offset: int, flags: int) -> int:
        """Queue a read or write of ``nbytes`` bytes at address ``ptr``; returns the op id. Never blocks on IO."""
    def wait(self, op_id: int, timeout_s: float = -1.0) -> Optional[_Result]:
        """The op's result (and forgets the op), or None on timeout; releases the GIL."""
    def done(self, op_id: int) -> bool: ...
    def pending(self) -> int:
        """Ops submitted and not yet collected by wait()."""
    def close(self) -> None:
        """Waits for in-flight ops and joins the threads; idempotent."""
    @property
    def engine(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def single_submit(self) -> bool: ...
    @property
    def overlap_events(self) -> bool: ...
    @property
    def intra_op_parallelism(self) -> int: ...
