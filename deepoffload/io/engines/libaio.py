"""The libaio engine of the native op (Linux kernel AIO, compiled in when libaio's header and library are found)."""

from .native_engine import NativeEngine

ENGINE = NativeEngine(
    "libaio", "Linux kernel AIO through libaio (io_submit), O_DIRECT; compiled in when libaio is found"
)
