"""Facts about this machine, the native op and a folder, gathered as plain data (dicts of str, int, bool).

``deepoffload report`` renders them; ``bench`` and ``tune`` consult them.

Torch-free and it never builds: probe results come from the cache (or a compile of each probe), the op is loaded only
when already built (prebuilt or in the cache), and a folder is checked by writing a small temporary file: free space,
filesystem and mount point, whether O_DIRECT works there and the smallest alignment it accepts.
"""

from __future__ import annotations

import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .version import __version__

CANNOT_CREATE = "cannot create a file there"


# -- gathering ----------------------------------------------------------------------------------------------------
def _first_line(cmd: list[str], any_status: bool = False) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # the tool is missing or hangs: the fact is unknown (None)
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0].strip() if (out.returncode == 0 or any_status) and lines else None


def compiler_version(toolchain) -> str | None:
    """The compiler's own first line: ``c++ --version``, or MSVC's banner (``cl`` alone prints it)."""
    if not toolchain.compiler_path:
        return None
    if toolchain.is_windows:
        return _first_line(toolchain.compiler.split(), any_status=True)
    return _first_line([*toolchain.compiler.split(), "--version"])


def library_version(deb: str, rpm: str, soname: str) -> str | None:
    """The installed version of a system library, from the package manager or its file name."""
    if shutil.which("dpkg-query"):
        for name in (deb, f"{deb}t64"):
            v = _first_line(["dpkg-query", "-W", "-f=${Version}", name])
            if v:
                return v
    if shutil.which("rpm"):
        v = _first_line(["rpm", "-q", "--qf", "%{VERSION}", rpm])
        if v and "not installed" not in v:
            return v
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64"):
        found = sorted(Path(d).glob(f"{soname}.so.*"))
        if found:
            return f"{found[-1].resolve().name} (file)"
    return None


def versions(builder) -> dict:
    """The versions the report shows: deepoffload, torch, Python, the compiler, the kernel, and the cache folder.

    Args:
        builder: An op builder (``op_builder.OpBuilder``) whose toolchain is asked.

    Returns:
        The versions by name; off Windows also ``libaio`` and ``liburing`` (None where not found); ``save_crc``:
        the library computing ``deepoffload.save``'s large CRC-32s (libdeflate is about 3x zlib).
    """
    from .io.crc import backend as crc_backend
    from .op_builder.cache import cache_root
    from .op_builder.versions import torch_version

    compiler = compiler_version(builder.toolchain)
    info: dict[str, str | None] = {  # a library's version is None when it is not found
        "deepoffload": __version__,
        "torch": torch_version(),
        "python": platform.python_version(),
        "compiler": compiler or f"{builder.toolchain.compiler} (not found)",
        "kernel": f"{platform.system()} {platform.release()}",
        "cache_dir": str(cache_root()),
    }
    if not builder.toolchain.is_windows:
        info["libaio"] = library_version("libaio1", "libaio", "libaio")
        info["liburing"] = library_version("liburing2", "liburing", "liburing")
    crc = crc_backend()
    info["save_crc"] = crc if crc == "libdeflate" else f"{crc} (libdeflate0 would be about 3x faster)"
    return info


def op_status(builder, results: dict) -> dict:
    """One row of the ops table, loading the op (never building it) to self-test its engines.

    Args:
        builder: The op's builder (``op_builder.OpBuilder``).
        results: The builder's probe results, by probe name.

    Returns:
        The row: whether the op is installed, compatible and built (where), its buildable engines, each probe's
        status with an install hint, and, when built, each engine's self-test and the engine ``auto`` picks
        (``load_error`` when loading fails, ``prebuilt_mismatch`` when the prebuilt op is for another torch).
    """
    from .op_builder.hints import install_hint

    prebuilt = builder.prebuilt_info()
    row = {
        "name": builder.NAME,
        "installed": prebuilt is not None,
        "compatible": builder.is_compatible(results),
        "engines_buildable": builder.engines(results),
        "built": None,
        "engines": {},
        "auto_engine": None,
        "probes": {},
    }
    for name, r in results.items():
        row["probes"][name] = {
            "status": "ok" if r.ok else ("n/a" if not r.applicable else "missing"),
            "reason": r.reason,
            "output_tail": list(r.output_tail),
            "hint": "" if r.ok else install_hint(name, builder.platform),
        }
    directory = None
    if results["cxx"].ok:
        try:
            directory = builder.finished_build(results)
        except OSError:
            directory = None
    if prebuilt is not None and not builder.prebuilt_matches(prebuilt):
        row["prebuilt_mismatch"] = (
            f"the prebuilt op was built for torch {prebuilt.get('torch')} "
            f"({prebuilt.get('python')}); it will be built just in time instead"
        )
    if builder.prebuilt_matches(prebuilt):
        row["built"] = "prebuilt"
    elif directory is not None:
        row["built"] = str(directory)
    if row["built"] and builder.platform == sys.platform:
        try:
            from .io import native

            for engine in native.compiled_engines():
                ok, reason = native.self_test(engine)
                row["engines"][engine] = {"ok": ok, "reason": reason}
            row["auto_engine"] = next((e for e, s in row["engines"].items() if s["ok"]), None)
        except Exception as e:  # the report must describe a broken op, not die of it
            row["load_error"] = f"{type(e).__name__}: {e}"
    return row


def filesystem(path: Path) -> tuple[str, str]:
    """(filesystem type, mount point) of ``path``, from /proc/mounts (``("unknown", "/")`` where there is none)."""
    best = ("unknown", "/")
    try:
        real = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1].replace("\\040", " ")
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[1]):
                best = (parts[2], mount)
    except OSError:  # no /proc/mounts (not Linux): the documented ("unknown", "/")
        pass
    return best


@dataclass(frozen=True)
class DirectIO:
    """Whether O_DIRECT writes work in a folder.

    Attributes:
        works: True when O_DIRECT writes work there.
        alignment: The smallest length and offset (bytes) accepted from page-aligned memory; None when they do not
            work.
        reason: Why not, when they do not work (else empty).
    """

    works: bool
    alignment: int | None = None
    reason: str = ""


def direct_io(folder: Path) -> DirectIO:
    """O_DIRECT support in ``folder``, found by writing a small temporary file there (removed after)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return DirectIO(False, reason="O_DIRECT does not exist on this platform")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".deepoffload-dio-")
    except OSError as e:  # e.g. /proc or /sys: a folder the superuser may "write" that takes no files
        return DirectIO(False, reason=f"{CANNOT_CREATE}: {e.strerror}")
    os.close(fd)
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | flag)
        except OSError as e:
            return DirectIO(False, reason=f"open with O_DIRECT refused: {e.strerror}")
        try:
            with mmap.mmap(-1, 8192) as buf:  # page-aligned memory
                reason: str | None = ""  # OSError.strerror may be None
                for alignment in (512, 1024, 2048, 4096):
                    try:
                        os.pwrite(fd, memoryview(buf)[:alignment], alignment)
                        return DirectIO(True, alignment)
                    except OSError as e:
                        reason = e.strerror
                return DirectIO(False, reason=f"aligned writes refused: {reason}")
        finally:
            os.close(fd)
    finally:
        os.unlink(tmp)


def direct_io_works(path: str | os.PathLike) -> bool:
    """True when O_DIRECT writes work where ``path`` (a file or a folder) lives."""
    path = Path(path)
    return direct_io(path if path.is_dir() else path.parent).works


def path_status(path: str) -> dict:
    """Facts about the folder ``path``, with ``error`` when deepoffload cannot use it.

    Args:
        path: The folder.

    Returns:
        Its free and total bytes, filesystem, mount point, device (``major:minor`` of ``st_dev``), whether it is
        writable, O_DIRECT support and its
        alignment; ``error`` says why deepoffload cannot use it (only the path and ``error`` when it is not an
        existing folder).
    """
    p = Path(path)
    row: dict = {"path": str(p)}
    if not p.is_dir():
        row["error"] = "not an existing folder"
        return row
    usage = shutil.disk_usage(p)
    fstype, mount = filesystem(p)
    device = os.stat(p).st_dev
    row.update(
        free_bytes=usage.free, total_bytes=usage.total, filesystem=fstype, mount=mount, writable=os.access(p, os.W_OK)
    )
    row["device"] = f"{os.major(device)}:{os.minor(device)}"  # (st_dev: folders on one device are one drive)
    if row["writable"]:
        direct = direct_io(p)
        row.update(direct_io=direct.works, alignment=direct.alignment, direct_io_reason=direct.reason)
        if direct.reason.startswith(CANNOT_CREATE):
            row.update(writable=False, error=f"not a folder deepoffload can use ({fstype} filesystem): {direct.reason}")
    else:
        row.update(
            direct_io=None,
            alignment=None,
            direct_io_reason="folder is not writable",
            error="not writable by this user: swap files cannot be created there",
        )
    return row


def gather(path: str | None = None, use_cache: bool = True) -> dict:
    """Everything ``deepoffload report`` shows: versions, each op's status and, given a folder, its facts.

    Args:
        path: A folder to check (see ``path_status``); None: none.
        use_cache: Take probe results from the on-disk cache where it has them (False: compile every probe again).

    Returns:
        ``versions``, ``ops`` (one row per op, see ``op_status``), ``engines`` (one row per registered engine, see
        ``engine_rows``), and ``path`` when a folder was given.
    """
    from .op_builder import ALL_OPS

    ops = []
    version_info = None
    for builder_class in ALL_OPS.values():
        builder = builder_class()
        results = builder.probe_results(use_cache=use_cache)
        ops.append(op_status(builder, results))
        version_info = version_info or versions(builder)
    report = {"versions": version_info, "ops": ops, "engines": engine_rows(ops)}
    if path:
        report["path"] = path_status(path)
    return report


def engine_rows(ops: list[dict]) -> list[dict]:
    """One row per registered engine (``deepoffload.io.engines``), in the order ``auto`` tries them.

    A native engine's state comes from the async-IO op's row (never built here for it); another engine's from its
    own ``status()``.

    Args:
        ops: The ops' rows (``op_status``).

    Returns:
        Rows of ``name``, ``description``, ``state`` ("ok", "fails", "not compiled in", "when built") and
        ``reason``.
    """
    from .io.engines import engines

    op = next((row for row in ops if row["name"] == "async_io"), None)
    rows = []
    for engine in engines():
        if not engine.native:
            ok, reason = engine.status()
            state = "ok" if ok else "fails"
        elif op is not None and op["engines"]:
            known = op["engines"].get(engine.name)
            ok, reason = (known["ok"], known["reason"]) if known else (False, "not in this build")
            state = "ok" if ok else ("fails" if known else "not compiled in")
        elif op is not None and engine.name in op["engines_buildable"]:
            state, reason = "when built", ""
        else:
            state, reason = "not compiled in", "its library or platform is missing here (see the probes)"
        rows.append({"name": engine.name, "description": engine.description, "state": state, "reason": reason})
    return rows
