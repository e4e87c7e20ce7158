"""One helper for the packages whose public names are imported on first access (PEP 562).

Importing such a package stays cheap (no torch) until a name that needs more is used.

Each such package lists its names once, per module, for this helper, and again in an ``if TYPE_CHECKING:`` block of
plain imports that type checkers and IDEs read; ``tests/test_api.py`` checks that the two lists agree.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Mapping, Sequence


def lazy_exports(
    package: str, modules: Mapping[str, Sequence[str]], eager: Sequence[str] = ()
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package``, whose names are imported on first access.

    A name is imported on first access and then cached as a package attribute.

    Args:
        package: The package's ``__name__``.
        modules: Each module (relative to ``package``, as ``".handle"``) mapped to the names it provides.
        eager: Names defined in the package itself (listed first in ``__all__``).

    Returns:
        The package's ``__all__``, its module ``__getattr__`` (``AttributeError`` for a name not listed) and its
        ``__dir__``.
    """
    where = {name: module for module, names in modules.items() for name in names}
    exported = [*eager, *where]

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(exported) | set(vars(sys.modules[package])))

    return exported, __getattr__, __dir__
