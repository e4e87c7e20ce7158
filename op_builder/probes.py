"""Probes: small programs that include the real header and call the real function, compiled and linked.

A probe that passes means the build will find the header, the symbol and the library with the same flags. A probe
that fails keeps the last lines of the compiler's output, which the report shows. Results are cached on disk, keyed
by the toolchain's identity and the probe's own text, so a warm report or build does not run the compiler.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from .cache import atomic_write_text, cache_root
from .toolchain import Toolchain

TAIL_LINES = 6
PROBE_TIMEOUT_S = 60


@dataclass(frozen=True)
class Probe:
    """One capability: a C++ program that must compile and link with ``libraries``."""

    name: str
    source: str
    libraries: tuple[str, ...] = ()
    description: str = ""

    def key(self) -> str:
        """A hash of the probe's name, source and libraries: its entry in the cache of probe results."""
        return hashlib.sha256(f"{self.name}\0{self.source}\0{self.libraries}".encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ProbeResult:
    """What a probe found.

    Attributes:
        name: The probe's name.
        ok: True when the program compiled and linked.
        reason: Why it failed (the compiler's first error line, or why the compiler did not run); empty when ok.
        output_tail: The last lines of the compiler's output of a failed probe.
        applicable: False when the probe does not apply on this platform (the Linux probes on Windows).
    """

    name: str
    ok: bool
    reason: str = ""
    output_tail: tuple[str, ...] = ()
    applicable: bool = True

    def to_json(self) -> dict:
        """The result as a JSON-ready dict (its fields, ``output_tail`` as a list)."""
        d = asdict(self)
        d["output_tail"] = list(self.output_tail)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ProbeResult":
        """The result that ``to_json`` wrote as ``d`` (missing optional fields take their defaults).

        Args:
            d: A dict from ``to_json``.

        Returns:
            The result.
        """
        return cls(d["name"], d["ok"], d.get("reason", ""), tuple(d.get("output_tail", ())), d.get("applicable", True))


def function_probe(name: str, header: str, call: str, libraries: tuple[str, ...] = (), description: str = "") -> Probe:
    """A probe that includes ``header`` and calls ``call`` (a statement) in ``main``."""
    source = f"#include <{header}>\nint main() {{\n  {call}\n  return 0;\n}}\n"
    return Probe(name, source, libraries, description)


def _reason(lines: list[str]) -> str:
    for line in lines:
        if "error" in line.lower() or "undefined reference" in line or "cannot find" in line:
            return line.strip()
    return lines[-1].strip() if lines else "compiler failed without output"


def run_probe(probe: Probe, toolchain: Toolchain) -> ProbeResult:
    """Compile and link ``probe`` with ``toolchain``; never raises for a compiler failure."""
    if not toolchain.compiler_path:
        return ProbeResult(probe.name, False, f"C++ compiler '{toolchain.compiler}' not found on PATH")
    with tempfile.TemporaryDirectory(prefix="deepoffload-probe-") as tmp:
        src = Path(tmp) / f"{probe.name}.cpp"
        src.write_text(probe.source)
        out = Path(tmp) / "probe"
        if toolchain.is_windows:  # MSVC: /Fe names the executable, libraries follow /link
            cmd = [
                *toolchain.compiler.split(),
                *toolchain.cflags,
                str(src),
                f"/Fe{out}.exe",
                "/link",
                *toolchain.ldflags,
                *(f"{lib}.lib" for lib in probe.libraries),
            ]
        else:
            cmd = [
                *toolchain.compiler.split(),
                *toolchain.cflags,
                str(src),
                "-o",
                str(out),
                *toolchain.ldflags,
                *(f"-l{lib}" for lib in probe.libraries),
            ]
        env = dict(os.environ)
        env.update(toolchain.env)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            return ProbeResult(probe.name, False, f"could not run {toolchain.compiler}: {e}")
    if proc.returncode == 0:
        return ProbeResult(probe.name, True)
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    return ProbeResult(probe.name, False, _reason(lines), tuple(lines[-TAIL_LINES:]))


def _cache_file(toolchain: Toolchain) -> Path:
    return cache_root() / "probes" / f"{toolchain.identity()}.json"


def run_probes(probes: list[Probe], toolchain: Toolchain, use_cache: bool = True) -> dict[str, ProbeResult]:
    """Results for every probe, from the disk cache where it has them, compiling (in parallel) where not."""
    path = _cache_file(toolchain)
    cached: dict = {}
    if use_cache:
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
    results: dict[str, ProbeResult] = {}
    missing = []
    for probe in probes:
        entry = cached.get(probe.key())
        if entry:
            results[probe.name] = ProbeResult.from_json(entry)
        else:
            missing.append(probe)
    if missing:
        with ThreadPoolExecutor(max_workers=max(1, min(len(missing), os.cpu_count() or 1))) as pool:
            for probe, result in zip(missing, pool.map(lambda p: run_probe(p, toolchain), missing)):
                results[probe.name] = result
                cached[probe.key()] = result.to_json()
        if use_cache:
            atomic_write_text(path, json.dumps(cached, indent=1))
    return results
