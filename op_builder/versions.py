"""What a binary is built for: deepoffload's, torch's and Python's versions, read without importing either package.

They go into every build key and are what a prebuilt op's record is checked against. ``package_version`` reads
``deepoffload/version.py`` as a file (``setup.py`` uses it too), ``torch_version`` reads torch's installed metadata
unless torch is imported already, ``python_abi`` names the interpreter and platform.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from pathlib import Path

from .build_errors import BuildError

HERE = Path(__file__).resolve().parent
# deepoffload's own folder, found by path (never imported from here): the parent of this folder when installed as
# deepoffload/op_builder, its sibling in a source checkout (op_builder/ next to deepoffload/)
PACKAGE_DIRS = (HERE.parent, HERE.parent / "deepoffload")

_VERSION = re.compile(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", re.MULTILINE)


def package_version() -> str:
    """deepoffload's version, read from ``deepoffload/version.py`` without importing deepoffload.

    ``version.py`` is the file the package itself imports; it lies beside this folder when installed
    (``deepoffload/op_builder``), one level down in a source checkout (``op_builder/`` next to ``deepoffload/``).

    Returns:
        The ``__version__`` string of ``version.py``.

    Raises:
        BuildError: When no readable ``version.py`` with a ``__version__`` line is found (reinstall deepoffload).
    """
    for directory in PACKAGE_DIRS:
        try:
            match = _VERSION.search((directory / "version.py").read_text())
        except OSError:  # not in this folder: try the next, and raise below when none has it
            continue
        if match:
            return match.group(1)
    raise BuildError("deepoffload", [f"deepoffload's version.py was not found beside {HERE}"], "reinstall deepoffload")


def torch_version() -> str:
    """torch's version without importing torch (1.4 s here) when it is not imported yet."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.__version__
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:  # torch not installed: the version keys say so, and loading the op refuses
        return "none"


def python_abi() -> str:
    """The interpreter's cache tag and platform (e.g. ``cpython-311-linux-x86_64``): what a binary is built for."""
    return f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"
