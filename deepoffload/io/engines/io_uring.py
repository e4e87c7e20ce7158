"""The io_uring engine of the native op (Linux 5.1+, compiled in when liburing's header and library are found)."""

from .native_engine import NativeEngine

ENGINE = NativeEngine(
    "io_uring", "Linux io_uring through liburing: one ring per thread, O_DIRECT; compiled in when liburing is found"
)
