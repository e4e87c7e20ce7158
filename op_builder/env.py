"""Every environment variable deepoffload reads, in one table, read through one parser.

It lives in ``op_builder`` (the lowest layer: stdlib only, nothing from ``deepoffload``) because ``setup.py`` and the
op builders read variables too and cannot import ``deepoffload``; ``deepoffload`` reads its own through here as
well. Adding a variable means adding a row to ``VARIABLES``. Values are read when asked for, not at import, so a
changed environment (a test's ``monkeypatch.setenv``) is seen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Union

from .errors import DeepOffloadError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")

Value = Union[bool, int, str, Path, None]


class EnvError(DeepOffloadError, ValueError):
    """A variable's value cannot be parsed; the message names the variable, the value and what is accepted."""


@dataclass(frozen=True)
class Variable:
    """One environment variable deepoffload reads.

    Attributes:
        name: The variable's name.
        kind: ``flag`` (1/0, true/false, yes/no, on/off), ``int``, ``text`` or ``path``.
        default: The value when unset (or, for a ``path``, empty).
        meaning: What it sets (shown in the documentation's table).
    """

    name: str
    kind: str
    default: Value
    meaning: str


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable("DEEPOFFLOAD_BUILD_OPS", "flag", False, "setup.py: prebuild every op into the package"),
        Variable("DEEPOFFLOAD_BUILD_AIO", "flag", False, "setup.py: prebuild the async-IO op into the package"),
        Variable(
            "DEEPOFFLOAD_CACHE_DIR",
            "path",
            None,
            "probe results and just-in-time builds (default $XDG_CACHE_HOME/deepoffload, else ~/.cache/deepoffload)",
        ),
        Variable("XDG_CACHE_HOME", "path", None, "the user's cache folder, when DEEPOFFLOAD_CACHE_DIR is unset"),
        Variable("DEEPOFFLOAD_SANITIZE", "text", "", "build the op with these sanitizers (-fsanitize=, e.g. address)"),
        Variable("RANK", "int", 0, "this process's rank (set by torchrun) when torch.distributed is not initialised"),
        Variable(
            "DEEPOFFLOAD_DEEPSPEED",
            "text",
            "",
            "1: a Python process calls deepoffload.integrations.deepspeed."
            "enable() once it imports deepspeed (the installed deepoffload-deepspeed.pth reads it; enable() sets "
            "it for child processes)",
        ),
        Variable("NO_COLOR", "text", "", "any value: command output has no colours"),
        # the compiler and flags the probes and builds share (read together by op_builder.toolchain)
        Variable("CXX", "text", "", "the C++ compiler (default c++, cl on Windows)"),
        Variable("CPPFLAGS", "text", "", "C preprocessor flags for probes and builds"),
        Variable("CFLAGS", "text", "", "compiler flags for probes and builds"),
        Variable("CXXFLAGS", "text", "", "C++ compiler flags for probes and builds"),
        Variable("LDFLAGS", "text", "", "linker flags for probes and builds (-L folders are also used for rpaths)"),
        Variable("CPATH", "text", "", "extra include folders (read by the compiler itself)"),
        Variable("LIBRARY_PATH", "text", "", "extra library folders (read by the compiler; also used for rpaths)"),
        Variable("CONDA_PREFIX", "path", None, "an active conda environment: its include/ and lib/ are used"),
        # torch's own, read as torch.load reads them so deepoffload.load resolves weights_only as torch.load does
        Variable(
            "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "text", "0", "torch.load's: weights_only=True forced (1, y, yes, true)"
        ),
        Variable(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD",
            "text",
            "0",
            "torch.load's: weights_only=False unless asked for (1, y, yes, true)",
        ),
    )
}
TOOLCHAIN = ("CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CPATH", "LIBRARY_PATH", "CONDA_PREFIX")

# DEEPOFFLOAD_AIO_<KEY> sets an async-IO config key; deepoffload.config lists the keys and parses them by their type
AIO_PREFIX = "DEEPOFFLOAD_AIO_"


def parse(name: str, kind: str, text: str) -> Value:
    """``text`` (the value of variable ``name``) as ``kind``; ``EnvError`` when it is not one."""
    if kind == "flag":
        lowered = text.strip().lower()
        if lowered in TRUE:
            return True
        if lowered in FALSE:
            return False
        raise EnvError(f"{name}={text!r}: expected 1/0/true/false (or yes/no, on/off); set it to one or unset it")
    if kind == "int":
        stripped = text.strip()
        try:  # decimal (leading zeros too) or with a base prefix (0x...), as config files accept
            return int(stripped, 10 if stripped.isdigit() else 0)
        except ValueError:
            raise EnvError(f"{name}={text!r}: expected an integer; set it to one or unset it") from None
    if kind == "path":
        return Path(text).expanduser() if text else None
    if kind == "text":
        return text.strip()
    raise ValueError(f"unknown variable kind {kind!r}")


def get(name: str, environ: Mapping[str, str] | None = None) -> Value:
    """The value of the variable ``name`` (a row of ``VARIABLES``), parsed; its default when unset."""
    variable = VARIABLES[name]
    environ = os.environ if environ is None else environ
    text = environ.get(name)
    if text is None or (variable.kind == "path" and not text):
        return variable.default
    return parse(name, variable.kind, text)


def get_path(name: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """``get`` for a ``path`` variable (typed as what it returns: a path, or None when unset or empty)."""
    value = get(name, environ)
    if value is not None and not isinstance(value, Path):
        raise TypeError(f"{name} is a {VARIABLES[name].kind} variable, not a path: read it with env.get()")
    return value


def raw(names: tuple[str, ...], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The unparsed values of those of ``names`` that are set.

    The compiler's own variables are passed on as they are.

    Args:
        names: Variables of ``VARIABLES``.
        environ: The environment to read (default: ``os.environ``).

    Returns:
        The set variables' values, by name.

    Raises:
        KeyError: When a name is not in ``VARIABLES``.
    """
    environ = os.environ if environ is None else environ
    for name in names:
        if name not in VARIABLES:
            raise KeyError(f"{name} is not in op_builder.env.VARIABLES")
    return {name: environ[name] for name in names if name in environ}


def prefixed(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every variable whose name starts with ``prefix`` (e.g. ``AIO_PREFIX``), sorted by name, unparsed."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in sorted(environ) if name.startswith(prefix)}
