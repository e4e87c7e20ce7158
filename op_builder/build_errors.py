"""A failed build: ``BuildError``, with the compiler's lines that say what went wrong and what to do about it.

``compiler_error_lines`` picks those lines out of the compiler's output; ``build_hint`` reads them for a missing
library, tool or header and names the command that installs it (else it gives advice on the compiler).
"""

from __future__ import annotations

import re
import sys

from .errors import DeepOffloadError
from .hints import install_hint


class BuildError(DeepOffloadError, RuntimeError):
    """The op could not be built; ``compiler_lines`` holds the compiler's error lines and ``hint`` what to do.

    The message names the op, shows the compiler's lines (or "(no compiler output)") and ends with the hint.

    Args:
        op: The op that failed to build (e.g. ``async_io``).
        compiler_lines: The lines of the compiler's output that say what went wrong.
        hint: What to do about it (e.g. the command that installs a missing package).

    Attributes:
        op: The op that failed to build.
        compiler_lines: The compiler's error lines.
        hint: What to do about it.
    """

    def __init__(self, op: str, compiler_lines: list[str], hint: str):
        self.op = op
        self.compiler_lines = compiler_lines
        self.hint = hint
        shown = "\n  ".join(compiler_lines) or "(no compiler output)"
        super().__init__(f"building the {op} op failed:\n  {shown}\nhint: {hint}")


_ERROR_LINE = re.compile(r"(error|undefined reference|cannot find|no such file|fatal)", re.IGNORECASE)


def compiler_error_lines(output: str, limit: int = 12) -> list[str]:
    """The lines of a compiler's output that say what went wrong (or its last lines)."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line) and not line.startswith("FAILED:")]
    return (errors or lines)[-limit:]


def build_hint(lines: list[str], platform: str = sys.platform) -> str:
    """What to do about a failed build, read from the compiler's error lines.

    Args:
        lines: The compiler's error lines (from ``compiler_error_lines``).
        platform: The platform whose install commands to suggest.

    Returns:
        The install command of a missing libaio, liburing, ninja or Python headers, else advice on the compiler.
    """
    text = "\n".join(lines).lower()
    if "libaio" in text:
        return install_hint("libaio", platform)
    if "liburing" in text:
        return install_hint("liburing", platform)
    if "ninja" in text:
        return "pip install ninja"
    if "python.h" in text:
        return "install the Python development headers (apt-get install python3-dev)"
    return (
        f"check the compiler ({install_hint('cxx', platform)}); set CXX to choose another; "
        f"run `deepoffload report` for what was found"
    )
