"""Op builders: probe the machine, then build the native ops just in time or load prebuilt ones.

Installed, this package is ``deepoffload.op_builder``; ``setup.py`` also imports it from the source tree to prebuild.
"""

from .async_io import AsyncIOBuilder
from .builder import BuildError, OpBuilder
from .probes import Probe, ProbeResult
from .toolchain import Toolchain

ALL_OPS = {AsyncIOBuilder.NAME: AsyncIOBuilder}


def _version_of_package() -> str:
    from deepoffload.version import __version__

    return __version__


__all__ = ["ALL_OPS", "AsyncIOBuilder", "BuildError", "OpBuilder", "Probe", "ProbeResult", "Toolchain"]
