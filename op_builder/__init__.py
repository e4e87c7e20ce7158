"""Op builders: probe the machine, then build the native ops just in time or load prebuilt ones.

The lowest Python layer: it imports nothing from ``deepoffload``, so it works both as the top-level ``op_builder``
of a source checkout (as ``setup.py`` imports it) and installed as ``deepoffload.op_builder``. Where both names reach
this one folder they are one module (``deepoffload._link`` makes the name imported second an alias of the first), so
there is one ``BuildError``. One exception, when an
op is loaded: ``AsyncIOBuilder().load()`` wraps the native module in deepoffload's DeepSpeed-shaped module (named by
``AsyncIOBuilder.WRAPPER``), so it returns one type whichever package was imported first; ``load_native()`` never
wraps.

Names are imported on first access, so importing this package runs no probe and costs next to nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "AsyncIOBuilder": ".async_io",
    "BuildError": ".build_errors",
    "OpBuilder": ".builder",
    "Probe": ".probes",
    "ProbeResult": ".probes",
    "Toolchain": ".toolchain",
}
__all__ = ["ALL_OPS", "AsyncIOBuilder", "BuildError", "OpBuilder", "Probe", "ProbeResult", "Toolchain"]


def __getattr__(name: str) -> Any:
    if name == "ALL_OPS":
        from .async_io import AsyncIOBuilder

        value: Any = {AsyncIOBuilder.NAME: AsyncIOBuilder}
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .async_io import AsyncIOBuilder
    from .build_errors import BuildError
    from .builder import OpBuilder
    from .probes import Probe, ProbeResult
    from .toolchain import Toolchain

    ALL_OPS: dict[str, type[OpBuilder]]
