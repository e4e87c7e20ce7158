"""The compiler and the flags that probes and builds share.

Everything the user's environment says about compiling (``CXX``, ``CFLAGS``, ``CXXFLAGS``, ``LDFLAGS``, ``CPATH``,
``LIBRARY_PATH``, ``$CONDA_PREFIX``) is read here once, so the probe that decides a library is present and the build
that links it see the same flags.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import env

ENV_VARS = env.TOOLCHAIN
SYSTEM_LIB_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")


@dataclass(frozen=True)
class Toolchain:
    """A C++ compiler and the user's flags, as the environment gives them.

    Attributes:
        compiler: The compiler command (``CXX``, default ``c++``, ``cl`` on Windows).
        compiler_path: The compiler's path on ``PATH``, or None when it is not found.
        cflags: ``CPPFLAGS``, ``CFLAGS`` and ``CXXFLAGS`` (plus conda's include folder).
        ldflags: ``LDFLAGS`` (plus conda's lib folder).
        lib_dirs: The library folders of ``-L`` flags, ``LIBRARY_PATH`` and conda, for rpaths.
        env: The toolchain variables that are set, unparsed (passed on to the compiler).
        platform: The platform (``sys.platform``'s value) compiled for.
    """

    compiler: str
    compiler_path: str | None
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    lib_dirs: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    platform: str = sys.platform

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None, platform: str = sys.platform) -> "Toolchain":
        """The toolchain the environment's ``CXX``, flags, ``LIBRARY_PATH`` and ``CONDA_PREFIX`` describe.

        Args:
            environ: The environment to read (default: ``os.environ``).
            platform: The platform compiled for (default: ``sys.platform``).

        Returns:
            The toolchain.
        """
        environ = env.raw(ENV_VARS, environ)
        compiler = environ.get("CXX") or ("cl" if platform == "win32" else "c++")
        cflags: list[str] = []
        for var in ("CPPFLAGS", "CFLAGS", "CXXFLAGS"):
            cflags += shlex.split(environ.get(var, ""))
        ldflags = shlex.split(environ.get("LDFLAGS", ""))
        lib_dirs = [flag[2:] for flag in ldflags if flag.startswith("-L") and len(flag) > 2]
        lib_dirs += [p for p in environ.get("LIBRARY_PATH", "").split(os.pathsep) if p]
        conda = environ.get("CONDA_PREFIX")
        if conda:
            cflags.append(f"-I{Path(conda) / 'include'}")
            ldflags.append(f"-L{Path(conda) / 'lib'}")
            lib_dirs.append(str(Path(conda) / "lib"))
        return cls(
            compiler=compiler,
            compiler_path=shutil.which(compiler.split()[0]) if compiler else None,
            cflags=tuple(cflags),
            ldflags=tuple(ldflags),
            lib_dirs=tuple(dict.fromkeys(lib_dirs)),
            env=environ,
            platform=platform,
        )

    @property
    def is_windows(self) -> bool:
        """True when compiling for Windows (MSVC's command line)."""
        return self.platform == "win32"

    def rpath_flags(self, library: str) -> list[str]:
        """``-Wl,-rpath`` for each non-system directory that holds ``lib<library>.so``.

        A library found through ``LDFLAGS``, ``LIBRARY_PATH`` or conda is then also found at run time.

        Args:
            library: The library's name without ``lib`` and suffix (e.g. ``aio``).

        Returns:
            One ``-Wl,-rpath,<dir>`` flag per such directory.
        """
        flags = []
        for d in self.lib_dirs:
            if os.path.realpath(d) in SYSTEM_LIB_DIRS:
                continue
            if any(Path(d).glob(f"lib{library}.so*")):
                flags.append(f"-Wl,-rpath,{d}")
        return flags

    def identity(self) -> str:
        """A hash of everything that can change a probe's answer: the compiler binary and the flags."""
        h = hashlib.sha256()
        h.update(self.compiler.encode())
        if self.compiler_path:
            try:
                st = os.stat(self.compiler_path)
                h.update(f"{os.path.realpath(self.compiler_path)}:{st.st_size}:{st.st_mtime_ns}".encode())
            except OSError:  # a compiler that cannot be stat'ed cannot run: its probes fail, whatever the key
                pass
        for key in sorted(self.env):
            h.update(f"{key}={self.env[key]}\0".encode())
        h.update(self.platform.encode())
        return h.hexdigest()[:16]
