"""``deepoffload.op_builder`` everywhere, and one module whichever of its two names is imported.

The op builders are installed as ``deepoffload.op_builder``; a source checkout also has them as the top-level
``op_builder`` (``setup.py`` imports it). Used without installing, the checkout's ``op_builder/`` is loaded under the
package's name. Where both names reach the same folder (a bare checkout, or an editable install run from its root),
they are one module: the name imported second is an alias of the first, its submodules too, so that
``except op_builder.BuildError`` catches what ``deepoffload.op_builder`` raises. Cheap: the op builders import their
parts on first use. (The async-IO op's ``load()`` wraps its native module in the DeepSpeed-shaped
``deepoffload.io.compat.CompatModule`` itself, by name: ``AsyncIOBuilder.WRAPPER``.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

OP_BUILDER = f"{__package__}.op_builder"
TOP_LEVEL = "op_builder"
CHECKOUT = Path(__file__).resolve().parent.parent / "op_builder"  # a source checkout's op_builder/, if any


def op_builder() -> ModuleType:
    """``deepoffload.op_builder``: the installed one, else the checkout's ``op_builder/`` loaded under that name.

    When the top-level ``op_builder`` of the same folder is imported already, it is that module; otherwise a later
    ``import op_builder`` of the same folder gives this one.

    Returns:
        The module.

    Raises:
        ImportError: When it is not installed and there is no checkout's ``op_builder/`` beside this package.
    """
    if OP_BUILDER in sys.modules:
        return sys.modules[OP_BUILDER]
    spec = importlib.util.find_spec(OP_BUILDER)
    origin = spec.origin if spec is not None else str(CHECKOUT / "__init__.py")
    top = sys.modules.get(TOP_LEVEL)
    if top is not None and _same_file(getattr(top, "__file__", None), origin):
        _alias(OP_BUILDER, top)
        sys.meta_path.insert(0, AliasFinder(OP_BUILDER, TOP_LEVEL))
        return top
    module = importlib.import_module(OP_BUILDER) if spec is not None else _load_checkout()
    sys.meta_path.insert(0, AliasFinder(TOP_LEVEL, OP_BUILDER))
    return module


def _load_checkout() -> ModuleType:
    """The checkout's ``op_builder/`` loaded as ``deepoffload.op_builder``."""
    spec = None
    if (CHECKOUT / "__init__.py").is_file():
        spec = importlib.util.spec_from_file_location(
            OP_BUILDER, CHECKOUT / "__init__.py", submodule_search_locations=[str(CHECKOUT)]
        )
    if spec is None or spec.loader is None:
        raise ImportError(
            f"{OP_BUILDER} is not installed and there is no source checkout's op_builder/ at "
            f"{CHECKOUT}; reinstall deepoffload (pip install deepoffload, or pip install -e . in a "
            f"checkout)"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[OP_BUILDER] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[OP_BUILDER]
        raise
    return module


def _same_file(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _alias(name: str, module: ModuleType) -> None:
    """Make ``name`` (a submodule of this package, or top-level) another name of ``module``."""
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``alias`` (and its submodules) give the modules of ``canonical`` already in use.

    Only where both names are one folder's: the top-level alias only when the normal import would load the same
    ``__init__.py`` as the canonical package's, its submodules only while the alias is the canonical package.

    Args:
        alias: The second name, e.g. ``"op_builder"``.
        canonical: The name the module was imported under first, e.g. ``"deepoffload.op_builder"``.
    """

    def __init__(self, alias: str, canonical: str):
        self.alias, self.canonical = alias, canonical

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec that gives the canonical module for ``fullname``, or None to leave the import alone.

        Args:
            fullname: The module being imported.
            path: The parent package's ``__path__`` (None for a top-level module).
            target: Not used.

        Returns:
            The spec, or None.
        """
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        canonical = sys.modules.get(self.canonical)
        if canonical is None:
            return None
        if fullname == self.alias:
            if "." in fullname:  # a submodule name: ``op_builder()`` made it an alias already, or it is not one
                return None
            found = importlib.machinery.PathFinder.find_spec(fullname, path)  # what the import would load
            if found is None or not _same_file(found.origin, getattr(canonical, "__file__", None)):
                return None
        elif sys.modules.get(self.alias) is not canonical:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The canonical module of ``spec.name``, imported under its canonical name if it is not yet.

        Args:
            spec: The spec from ``find_spec``.

        Returns:
            The module.
        """
        module = importlib.import_module(self.canonical + spec.name[len(self.alias) :])
        spec.loader_state = module.__spec__  # the import system sets ``spec`` on it next; exec_module restores it
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran under its canonical name; its own spec is put back.

        Args:
            module: The module from ``create_module``.
        """
        alias_spec = module.__spec__
        if alias_spec is not None and alias_spec.loader is self:
            module.__spec__ = alias_spec.loader_state
