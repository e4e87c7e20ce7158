"""Access to the native async-IO module: loading it, its compiled-in engines and their self-tests.

Which engine a handle uses is chosen by the engine registry (``deepoffload.io.engines``).
"""

from __future__ import annotations

import functools
import tempfile
import threading
from types import ModuleType

_self_tests: dict[str, tuple[bool, str]] = {}
_self_test_lock = threading.Lock()


def native() -> ModuleType:
    """The native module, built on first use (see ``deepoffload.op_builder``)."""
    return _native()


@functools.lru_cache(maxsize=None)
def _native() -> ModuleType:
    from ..op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load_native()


def self_test(engine: str) -> tuple[bool, str]:
    """(passed, reason) of the engine's runtime self-test, run once per process in a temporary folder."""
    with _self_test_lock:
        if engine not in _self_tests:
            from ..op_builder.cache import cache_root

            root = cache_root() / "selftest"
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root) as directory:
                _self_tests[engine] = tuple(native().self_test(engine, directory))
        return _self_tests[engine]


def compiled_engines() -> list[str]:
    """The engines compiled into the native op, best first (loads, and on first use builds, the op)."""
    return list(native().engines())
