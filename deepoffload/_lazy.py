"""One helper for the packages whose public names are imported on first access (PEP 562), so importing a package
stays cheap (no torch) until a name that needs more is used.

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
    """``(__all__, __getattr__, __dir__)`` for ``package``: ``modules`` maps a module (relative to ``package``, as
    ``".handle"``) to the names it provides; ``eager`` names are defined in the package itself. A name is imported
    on first access and then cached as a package attribute.
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
