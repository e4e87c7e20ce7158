"""``AsyncIOBuilder``: the async-IO op (csrc/aio), with its engines chosen by probing.

The op always builds where a C++ compiler works: the posix engine needs nothing else. The libaio engine is compiled
in when libaio's header and ``io_submit`` link; ``io_pgetevents`` reaps completions when libaio has it (>= 0.3.112),
else ``io_getevents``; the io_uring engine is compiled in when liburing's header and ``io_uring_queue_init`` link.
On Windows the library probes do not apply and the Windows engine is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .builder import CXX_PROBE, OpBuilder
from .probes import Probe, ProbeResult, function_probe

LIBAIO_PROBE = function_probe(
    "libaio",
    "libaio.h",
    "io_context_t ctx = 0; struct iocb cb; struct iocb* cbs[1] = {&cb}; (void)io_submit(ctx, 1, cbs);",
    ("aio",),
    "libaio (libaio.h, io_submit)",
)
PGETEVENTS_PROBE = function_probe(
    "io_pgetevents",
    "libaio.h",
    "io_context_t ctx = 0; struct io_event ev; (void)io_pgetevents(ctx, 1, 1, &ev, nullptr, nullptr);",
    ("aio",),
    "io_pgetevents (libaio >= 0.3.112)",
)
URING_PROBE = function_probe(
    "liburing",
    "liburing.h",
    "struct io_uring ring; (void)io_uring_queue_init(8, &ring, 0);",
    ("uring",),
    "liburing (liburing.h, io_uring_queue_init)",
)


@dataclass(frozen=True)
class Engine:
    """One row of the engine table: an engine, or (with ``requires``) an optional feature of one.

    Attributes:
        name: The engine's (or feature's) name.
        probe: The probe that must pass for the row to be compiled in (None: always compiled in).
        define: The preprocessor macro set (to 1) when the row is compiled in, or None.
        library: The library linked when the row is compiled in, or None.
        windows: True: the row applies on Windows only; False: everywhere else only.
        requires: The engine this row is a feature of (the row is then not listed among the engines), or None.
    """

    name: str
    probe: Probe | None = None
    define: str | None = None
    library: str | None = None
    windows: bool = False
    requires: str | None = None  # a feature of this engine, not an engine: not listed among the engines

    @property
    def is_engine(self) -> bool:
        """True for an engine, False for a feature of one (a row with ``requires``)."""
        return self.requires is None


# The one list of engines, best first: the compile flags, the report, deepoffload's config and command line all
# derive from it (csrc/aio declares the same names in its engine registry).
ENGINES = (
    Engine("io_uring", URING_PROBE, "DEEPOFFLOAD_HAVE_URING", "uring"),
    Engine("libaio", LIBAIO_PROBE, "DEEPOFFLOAD_HAVE_LIBAIO", "aio"),
    Engine("io_pgetevents", PGETEVENTS_PROBE, "DEEPOFFLOAD_HAVE_PGETEVENTS", requires="libaio"),
    Engine("posix"),
    Engine("windows", windows=True),
)
ENGINE_NAMES = tuple(e.name for e in ENGINES if e.is_engine)
LINUX_PROBES = tuple(e.probe for e in ENGINES if e.probe is not None and not e.windows)


class AsyncIOBuilder(OpBuilder):
    """Builds and loads the async-IO op.

    ``load()`` is always the DeepSpeed-shaped module (``load().aio_handle(...)`` gives a DeepSpeed-compatible
    handle), ``load_native()`` the extension itself.
    """

    NAME = "async_io"
    MODULE = "deepoffload_aio"
    WRAPPER = "deepoffload.io.compat:CompatModule"

    def source_files(self) -> list[Path]:
        """The op's C++ sources in csrc/aio: the Windows files on Windows, the posix files everywhere else."""
        files = sorted((self.csrc / "aio").glob("*.cpp"))
        if self.toolchain.is_windows:
            return [f for f in files if not f.stem.endswith("_posix")]
        return [f for f in files if not f.stem.endswith("_windows")]

    def probes(self) -> list[Probe]:
        """The C++ compiler probe, then (not on Windows) the probes of libaio, io_pgetevents and liburing."""
        if self.toolchain.is_windows:
            return [CXX_PROBE]
        return [CXX_PROBE, *LINUX_PROBES]

    def probe_results(self, use_cache: bool = True) -> dict[str, ProbeResult]:
        """Runs the probes (see ``OpBuilder.probe_results``); on Windows the Linux probes are reported not applicable.

        Args:
            use_cache: Read and update the on-disk cache of probe results (False: compile every probe again).

        Returns:
            Each probe's result by probe name, the Linux probes included on Windows (failed, ``applicable=False``).
        """
        results = super().probe_results(use_cache)
        if self.toolchain.is_windows:
            for probe in LINUX_PROBES:
                results[probe.name] = ProbeResult(probe.name, False, "not applicable on Windows", applicable=False)
        return results

    def compiled_rows(self, results: dict[str, ProbeResult]) -> list[Engine]:
        """The rows of ``ENGINES`` a build here would contain (engines and features), in table order."""
        rows: list[Engine] = []
        for row in ENGINES:
            if row.windows != self.toolchain.is_windows:
                continue
            if row.probe is not None and not results[row.probe.name].ok:
                continue
            if row.requires is not None and row.requires not in {r.name for r in rows}:
                continue
            rows.append(row)
        return rows

    def feature_flags(self, results: dict[str, ProbeResult]) -> tuple[list[str], list[str]]:
        """The ``-D`` defines and ``-l`` libraries (with their rpaths) of the rows a build here would contain.

        Args:
            results: The probe results, by probe name (from ``probe_results()``).

        Returns:
            (compile flags, link flags).
        """
        cflags: list[str] = []
        ldflags: list[str] = []
        for row in self.compiled_rows(results):
            if row.define:
                cflags.append(f"-D{row.define}=1")
            if row.library:
                ldflags += [f"-l{row.library}", *self.toolchain.rpath_flags(row.library)]
        return cflags, ldflags

    def engines(self, results: dict[str, ProbeResult]) -> list[str]:
        """Engines a build here would contain, best first."""
        return [row.name for row in self.compiled_rows(results) if row.is_engine]
