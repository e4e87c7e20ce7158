"""Access to the native async-IO module and engine selection (``auto`` -> the best engine whose self-test passes)."""

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


def engine_status() -> dict[str, tuple[bool, str]]:
    """Every compiled-in engine, best first, with its self-test result."""
    return {engine: self_test(engine) for engine in native().engines()}


def resolve_engine(requested: str) -> str:
    """The engine to use for ``requested``: itself (checked) or, for ``auto``, the best one that works here."""
    compiled = list(native().engines())
    if requested == "auto":
        failures = []
        for engine in compiled:
            ok, reason = self_test(engine)
            if ok:
                return engine
            failures.append(f"{engine}: {reason}")
        raise OSError(f"no async-IO engine works here ({'; '.join(failures)})")
    if requested not in compiled:
        raise ValueError(
            f"engine {requested!r} is not in this build (compiled in: {', '.join(compiled)}); "
            f"install its library and rebuild, or use engine='auto' (see `deepoffload report`)"
        )
    ok, reason = self_test(requested)
    if not ok:
        raise OSError(f"engine {requested!r} fails its self-test here: {reason}; use engine='auto'")
    return requested
