"""IO engines: the registry every list of engines derives from, and the built-in engines, best first.

To add an engine, write one file here (or anywhere: a test adds one) that defines it (a ``NativeEngine`` of the
native op, or a ``PythonEngine`` subclass) and ``register`` it; a native engine also needs its C++ file in csrc/aio
and its row in ``op_builder.async_io.ENGINES``. The handle asks the registry which engine to open
(``resolve_engine``); a native engine's transfers then run in the native op, never through Python.
"""

from __future__ import annotations

from . import io_uring, libaio, posix, windows
from .native_engine import NativeEngine
from .python_engine import PythonEngine
from .registry import (
    AUTO,
    FSYNC,
    TRUNCATE,
    Backend,
    Engine,
    Result,
    check_choice,
    choices,
    engine_status,
    engines,
    get,
    names,
    register,
    resolve_engine,
    unregister,
)

__all__ = [
    "AUTO",
    "FSYNC",
    "TRUNCATE",
    "Backend",
    "Engine",
    "NativeEngine",
    "PythonEngine",
    "Result",
    "check_choice",
    "choices",
    "engine_status",
    "engines",
    "get",
    "names",
    "register",
    "resolve_engine",
    "unregister",
]

for _module in (io_uring, libaio, posix, windows):  # best first: the order ``auto`` tries them in
    register(_module.ENGINE)
