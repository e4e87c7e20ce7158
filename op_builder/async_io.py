"""``AsyncIOBuilder``: the async-IO op (csrc/aio), with its engines chosen by probing.

The op always builds where a C++ compiler works: the posix engine needs nothing else. The libaio engine is compiled
in when libaio's header and ``io_submit`` link; ``io_pgetevents`` reaps completions when libaio has it (>= 0.3.112),
else ``io_getevents``; the io_uring engine is compiled in when liburing's header and ``io_uring_queue_init`` link.
On Windows the library probes do not apply and the Windows engine is used.
"""

from __future__ import annotations

from pathlib import Path

from .builder import CXX_PROBE, OpBuilder
from .probes import Probe, ProbeResult, function_probe

LIBAIO_PROBE = function_probe(
    "libaio", "libaio.h",
    "io_context_t ctx = 0; struct iocb cb; struct iocb* cbs[1] = {&cb}; (void)io_submit(ctx, 1, cbs);",
    ("aio",), "libaio (libaio.h, io_submit)")
PGETEVENTS_PROBE = function_probe(
    "io_pgetevents", "libaio.h",
    "io_context_t ctx = 0; struct io_event ev; (void)io_pgetevents(ctx, 1, 1, &ev, nullptr, nullptr);",
    ("aio",), "io_pgetevents (libaio >= 0.3.112)")
URING_PROBE = function_probe(
    "liburing", "liburing.h",
    "struct io_uring ring; (void)io_uring_queue_init(8, &ring, 0);",
    ("uring",), "liburing (liburing.h, io_uring_queue_init)")
LINUX_PROBES = (LIBAIO_PROBE, PGETEVENTS_PROBE, URING_PROBE)


class AsyncIOBuilder(OpBuilder):
    """Builds and loads the async-IO op (with deepoffload imported, ``load().aio_handle(...)`` gives a
    DeepSpeed-compatible handle)."""

    NAME = "async_io"
    MODULE = "deepoffload_aio"

    def source_files(self) -> list[Path]:
        files = sorted((self.csrc / "aio").glob("*.cpp"))
        if self.toolchain.is_windows:
            return [f for f in files if not f.stem.endswith("_posix")]
        return [f for f in files if not f.stem.endswith("_windows")]

    def probes(self) -> list[Probe]:
        if self.toolchain.is_windows:
            return [CXX_PROBE]
        return [CXX_PROBE, *LINUX_PROBES]

    def probe_results(self, use_cache: bool = True) -> dict[str, ProbeResult]:
        results = super().probe_results(use_cache)
        if self.toolchain.is_windows:
            for probe in LINUX_PROBES:
                results[probe.name] = ProbeResult(probe.name, False, "not applicable on Windows", applicable=False)
        return results

    def feature_flags(self, results: dict[str, ProbeResult]) -> tuple[list[str], list[str]]:
        cflags: list[str] = []
        ldflags: list[str] = []
        if self.toolchain.is_windows:
            return cflags, ldflags
        if results["libaio"].ok:
            cflags.append("-DDEEPOFFLOAD_HAVE_LIBAIO=1")
            if results["io_pgetevents"].ok:
                cflags.append("-DDEEPOFFLOAD_HAVE_PGETEVENTS=1")
            ldflags += ["-laio", *self.toolchain.rpath_flags("aio")]
        if results["liburing"].ok:
            cflags.append("-DDEEPOFFLOAD_HAVE_URING=1")
            ldflags += ["-luring", *self.toolchain.rpath_flags("uring")]
        return cflags, ldflags

    def engines(self, results: dict[str, ProbeResult]) -> list[str]:
        """Engines a build here would contain, best first."""
        if self.toolchain.is_windows:
            return ["windows"]
        found = []
        if results["liburing"].ok:
            found.append("io_uring")
        if results["libaio"].ok:
            found.append("libaio")
        return [*found, "posix"]
