"""``OpBuilder``: one base class that probes, builds just in time, and loads prebuilt or cached ops.

A concrete op is a small subclass that declares its sources, probes and flags (see ``async_io.py``). Loading goes:
prebuilt (installed with the package, used when the torch it was built against matches) -> a finished build in the
cache -> a just-in-time build through ``torch.utils.cpp_extension``, under a lock that many processes share and that
dies with its holder.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from . import env
from .build_errors import BuildError, build_hint, compiler_error_lines
from .cache import atomic_write_text, cache_root, exclusive_lock
from .hints import install_hint
from .probes import Probe, ProbeResult, function_probe, run_probes
from .toolchain import Toolchain
from .versions import PACKAGE_DIRS, package_version, python_abi, torch_version

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "csrc"
PREBUILT_PACKAGE = "deepoffload._ops"
BUILD_INFO = "build_info.json"
SANITIZE_ENV = "DEEPOFFLOAD_SANITIZE"

# The warnings of every build of the core (the JIT build, the prebuilt op, tests/native): it is clean under them.
WARNING_FLAGS = ("-Wall", "-Wextra")

CXX_PROBE = function_probe("cxx", "cstdio", 'std::puts("");', description="a working C++ compiler")

_loaded: dict[str, ModuleType] = {}
_load_lock = threading.Lock()
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Issues ``message`` as a ``RuntimeWarning`` the first time ``key`` is seen in this process, never again.

    Args:
        key: What the warning is about; a second warning with the same key is dropped.
        message: The warning's text.
    """
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class OpBuilder:
    """Base class of the op builders: probes, flags, build key, just-in-time build and loading.

    Subclasses set ``NAME`` (the op), ``MODULE`` (the native module's name) and override ``source_files``,
    ``probes`` and ``feature_flags``.

    Args:
        toolchain: The compiler and flags to probe and build with (default: read from the environment).
        platform: The platform to build for (default ``sys.platform``; another one simulates it: no prebuilt op).
        csrc: The folder of the C++ sources (default: ``csrc/`` of the source tree).
    """

    NAME = ""
    MODULE = ""
    WRAPPER: str | None = None  # "module:callable" that ``load()`` applies to the native module, or None

    def __init__(self, toolchain: Toolchain | None = None, platform: str = sys.platform, csrc: Path = CSRC):
        self.platform = platform
        self.toolchain = toolchain or Toolchain.from_environment(platform=platform)
        self.csrc = Path(csrc)

    # -- declared by subclasses -------------------------------------------------------------------------------
    def source_files(self) -> list[Path]:
        """The op's C++ sources (declared by each subclass).

        Returns:
            The paths of the sources to compile.

        Raises:
            NotImplementedError: Always, here: a subclass declares its sources.
        """
        raise NotImplementedError

    def probes(self) -> list[Probe]:
        """Probes this op uses; the C++ compiler probe is always first."""
        return [CXX_PROBE]

    def feature_flags(self, results: dict[str, ProbeResult]) -> tuple[list[str], list[str]]:
        """(compile flags, link flags) for the features whose probes passed."""
        return [], []

    def engines(self, results: dict[str, ProbeResult]) -> list[str]:
        """The engines a build here would contain, best first (none here; an op with engines overrides it).

        Args:
            results: The probe results, by probe name.

        Returns:
            The engine names.
        """
        return []

    # -- probing ----------------------------------------------------------------------------------------------
    def probe_results(self, use_cache: bool = True) -> dict[str, ProbeResult]:
        """Runs this op's probes, from the on-disk cache where it has them, compiling them where not.

        Args:
            use_cache: Read and update the on-disk cache of probe results (False: compile every probe again).

        Returns:
            Each probe's result, by probe name.
        """
        return run_probes(self.probes(), self.toolchain, use_cache=use_cache)

    def is_compatible(self, results: dict[str, ProbeResult] | None = None) -> bool:
        """True when the op can be built here (a C++ compiler works) or a usable prebuilt op is installed."""
        results = results if results is not None else self.probe_results()
        return results[CXX_PROBE.name].ok or self.prebuilt_matches()

    # -- flags and keys ---------------------------------------------------------------------------------------
    def base_cflags(self) -> list[str]:
        """The compile flags of every build: optimisation, C++17, warnings and ``DEEPOFFLOAD_SANITIZE``'s sanitizers."""
        if self.toolchain.is_windows:
            return ["/O2", "/std:c++17", "/EHsc"]
        flags = ["-O2", "-std=c++17", *WARNING_FLAGS]
        sanitize = env.get(SANITIZE_ENV)
        if sanitize:
            flags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"]
        return flags

    def build_flags(self, results: dict[str, ProbeResult] | None = None) -> tuple[list[str], list[str]]:
        """The compile and link flags of a build here: the base flags, the user's and those of the probed features.

        Off Windows and macOS the link flags also drop torch's libraries (``--as-needed``, libstdc++ first), so the op
        loads without ``import torch``.

        Args:
            results: The probe results, by probe name (default: ``probe_results()``).

        Returns:
            (compile flags, link flags).
        """
        results = results if results is not None else self.probe_results()
        cflags, ldflags = self.feature_flags(results)
        cflags = [*self.base_cflags(), *self.toolchain.cflags, *cflags]
        ldflags = [*self.toolchain.ldflags, *ldflags]
        if not self.toolchain.is_windows and self.platform != "darwin":
            # cpp_extension links torch's libraries after ours; the op uses none of them, but libc10 and
            # libtorch_cpu re-export a few libstdc++ symbols. Naming libstdc++ first and linking --as-needed drops
            # them, so the op loads without `import torch` (the report stays fast) and without torch's rpath.
            ldflags = ["-Wl,--as-needed", *ldflags, "-lstdc++"]
        sanitize = env.get(SANITIZE_ENV)
        if sanitize and not self.toolchain.is_windows:
            ldflags.append(f"-fsanitize={sanitize}")
        return cflags, ldflags

    def build_key(self, cflags: list[str], ldflags: list[str]) -> str:
        """A hash of everything that changes the binary.

        That is the package, torch and Python versions, the compiler, the flags and the sources' (and headers')
        bytes.

        Args:
            cflags: The compile flags of the build.
            ldflags: The link flags of the build.

        Returns:
            The first 16 hex digits of the SHA-256.
        """
        h = hashlib.sha256()
        for part in (
            package_version(),
            torch_version(),
            python_abi(),
            self.toolchain.identity(),
            *cflags,
            "|",
            *ldflags,
        ):
            h.update(part.encode() + b"\0")
        for src in sorted(self.all_source_files()):
            h.update(src.name.encode() + b"\0" + src.read_bytes())
        return h.hexdigest()[:16]

    def all_source_files(self) -> list[Path]:
        """Sources plus the headers they include (headers change the binary too)."""
        sources = self.source_files()
        headers = sorted({h for src in sources for h in src.parent.glob("*.h")})
        return [*sources, *headers]

    def build_dir(self, key: str) -> Path:
        """The cache folder of the build with ``key`` (``<cache>/build/<NAME>-<key>``)."""
        return cache_root() / "build" / f"{self.NAME}-{key}"

    # -- loading ----------------------------------------------------------------------------------------------
    def load(self, verbose: bool = False) -> Any:
        """The op's module: the native module, wrapped by ``WRAPPER`` when the op names one.

        For ``async_io`` that is deepoffload's DeepSpeed-shaped module, whatever was imported before; an op without
        ``WRAPPER`` returns the native module itself. ``load_native()`` never wraps.

        Args:
            verbose: Show the compiler's output if the op is built now.

        Returns:
            The wrapped module (or the native one).
        """
        native = self.load_native(verbose=verbose)
        if self.WRAPPER is None:
            return native
        module, _, name = self.WRAPPER.partition(":")
        return getattr(importlib.import_module(module), name)(native)

    def load_native(self, verbose: bool = False) -> ModuleType:
        """The native module: prebuilt if it matches this torch, else built (once) in the cache.

        Args:
            verbose: Show the compiler's output if the op is built now.

        Returns:
            The extension module, loaded once per process.
        """
        with _load_lock:
            module = _loaded.get(self.NAME)
            if module is None:
                # a sanitizer build is always built here: the prebuilt op has no sanitizers
                prebuilt = None if env.get(SANITIZE_ENV) else self._load_prebuilt()
                module = prebuilt or self.jit_load(verbose=verbose)
                _loaded[self.NAME] = module
            return module

    def prebuilt_info(self) -> dict | None:
        """The build record of the prebuilt op installed with the package, or None.

        Always None for a simulated other platform: what is installed here was built for this one.

        Returns:
            The op's record from ``_ops/build_info.json`` with ``torch``, ``python`` and ``folder`` added, or None
            when no prebuilt op is installed.
        """
        if self.platform != sys.platform:
            return None
        for directory in PACKAGE_DIRS:
            info_path = directory / "_ops" / BUILD_INFO
            try:
                info = json.loads(info_path.read_text())
            except (OSError, ValueError):  # no (readable) prebuilt op there: the op is built just in time instead
                continue
            op = info.get("ops", {}).get(self.NAME)
            if op:
                return {**op, "torch": info.get("torch"), "python": info.get("python"), "folder": str(info_path.parent)}
        return None

    def prebuilt_matches(self, info: dict | None = None) -> bool:
        """True when a prebuilt op is installed and was built for this torch and Python.

        Args:
            info: The prebuilt op's record (default: ``prebuilt_info()``).

        Returns:
            Whether the record exists and its torch version and Python ABI are this process's.
        """
        info = info if info is not None else self.prebuilt_info()
        return info is not None and info.get("torch") == torch_version() and info.get("python") == python_abi()

    def _load_prebuilt(self) -> ModuleType | None:
        info = self.prebuilt_info()
        if info is None:
            return None
        if not self.prebuilt_matches(info):
            warn_once(
                f"prebuilt-{self.NAME}",
                f"deepoffload: the prebuilt {self.NAME} op was built for torch {info.get('torch')} "
                f"({info.get('python')}), this is torch {torch_version()} ({python_abi()}); "
                f"building it just in time instead",
            )
            return None
        try:
            library = Path(info["folder"]) / f"{self.MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
            return _import_extension(f"{PREBUILT_PACKAGE}.{self.MODULE}", library)
        except ImportError as e:
            warn_once(
                f"prebuilt-{self.NAME}",
                f"deepoffload: the prebuilt {self.NAME} op does not load ({e}); building it just in time",
            )
            return None

    def jit_load(self, verbose: bool = False) -> ModuleType:
        """Load the cached build for the current sources and flags, building it first if needed.

        The build runs under a lock that other processes share; a process that finds it held waits (and says so).

        Args:
            verbose: Show the compiler's output if the op is built now.

        Returns:
            The extension module.

        Raises:
            BuildError: When no C++ compiler works (with the compiler probe's output and an install hint), or the
                build fails.
        """
        results = self.probe_results()
        if not results[CXX_PROBE.name].ok:
            r = results[CXX_PROBE.name]
            raise BuildError(self.NAME, list(r.output_tail) or [r.reason], install_hint("cxx", self.platform))
        cflags, ldflags = self.build_flags(results)
        key = self.build_key(cflags, ldflags)
        directory = self.build_dir(key)
        module = self._load_finished(directory)
        if module is not None:
            return module

        def say_waiting() -> None:
            print(
                f"deepoffload: waiting for another process that is building the {self.NAME} op in {directory}",
                file=sys.stderr,
                flush=True,
            )

        with exclusive_lock(directory.parent / f"{directory.name}.lock", on_wait=say_waiting):
            module = self._load_finished(directory)
            if module is not None:
                return module
            return self._build(directory, cflags, ldflags, verbose)

    def finished_build(self, results: dict[str, ProbeResult] | None = None) -> Path | None:
        """The cache directory of a finished build for the current sources and flags, or None (never builds).

        Args:
            results: The probe results, by probe name (default: ``probe_results()``).

        Returns:
            The build's folder when it holds ``ready.json``, else None.
        """
        cflags, ldflags = self.build_flags(results)
        directory = self.build_dir(self.build_key(cflags, ldflags))
        return directory if (directory / "ready.json").exists() else None

    def _load_finished(self, directory: Path) -> ModuleType | None:
        """Import a finished build, or discard (with a warning) one whose library is missing, altered or unloadable.

        A discarded build is rebuilt by the caller.

        Returns:
            The extension module, or None when there is no finished build (or it was discarded).
        """
        record_path = directory / "ready.json"
        if not record_path.exists():
            return None
        problem = None
        try:
            record = json.loads(record_path.read_text())
            library = directory / record["library"]
            if _sha256(library) != record["sha256"]:
                problem = "its library does not match the one that was built (truncated or altered)"
            else:
                return _import_extension(self.MODULE, library)
        except (OSError, ValueError, KeyError, ImportError) as e:
            problem = f"it does not load: {e}"
        warnings.warn(
            f"deepoffload: discarding the cached {self.NAME} build in {directory}: {problem}; rebuilding",
            RuntimeWarning,
            stacklevel=4,
        )
        record_path.unlink(missing_ok=True)
        return None

    def _build(self, directory: Path, cflags: list[str], ldflags: list[str], verbose: bool) -> ModuleType:
        from torch.utils import cpp_extension

        if directory.exists():
            shutil.rmtree(directory)  # leftovers of a killed or failed build, torch's stale 'lock' file included
        directory.mkdir(parents=True)
        last = _last_build_seconds()
        took = "" if last is None else f"; the last build here took {last} s"
        print(
            f"deepoffload: building the {self.NAME} op (first use for this torch and compiler{took}) in {directory}",
            file=sys.stderr,
            flush=True,
        )
        start = time.monotonic()
        env_before = os.environ.get("CXX")
        if self.toolchain.compiler and not self.toolchain.is_windows:
            os.environ["CXX"] = self.toolchain.compiler
        try:
            module = cpp_extension.load(
                name=self.MODULE,
                sources=[str(s) for s in self.source_files()],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(directory),
                verbose=verbose,
                with_cuda=False,
            )
        except (RuntimeError, OSError, ImportError) as e:
            lines = compiler_error_lines(str(e))
            raise BuildError(self.NAME, lines, build_hint(lines, self.platform)) from e
        finally:
            if env_before is None:
                os.environ.pop("CXX", None)
            else:
                os.environ["CXX"] = env_before
        seconds = time.monotonic() - start
        library = Path(module.__file__)
        atomic_write_text(
            directory / "ready.json",
            json.dumps(
                {
                    "library": library.name,
                    "sha256": _sha256(library),
                    "seconds": round(seconds, 1),
                    "cflags": cflags,
                    "ldflags": ldflags,
                },
                indent=1,
            ),
        )
        _record_build_seconds(seconds)
        return module


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _import_extension(name: str, library: Path) -> ModuleType:
    if not library.exists():
        raise ImportError(f"{library} does not exist")
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_times_path() -> Path:
    return cache_root() / "build-seconds.json"


def _last_build_seconds() -> int | None:
    """The last build's time on this machine (recorded by the builder); a figure from elsewhere would mislead.

    Returns:
        Seconds (at least 1), or None before any build here.
    """
    try:
        return max(1, round(json.loads(_build_times_path().read_text())["last"]))
    except (OSError, ValueError, KeyError, TypeError):  # no record (or a damaged one): the hint gives no figure
        return None


def _record_build_seconds(seconds: float) -> None:
    try:
        atomic_write_text(_build_times_path(), json.dumps({"last": round(seconds, 1)}))
    except OSError:  # only feeds a hint's time estimate; the build itself succeeded
        pass
