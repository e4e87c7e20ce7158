"""What ``import deepoffload`` does to the op builders below it (``op_builder/``, which imports nothing from here).

- In a source checkout used without installing, ``op_builder/`` beside this package is loaded as
  ``deepoffload.op_builder`` (an installed or editable package maps it there already), so ``deepoffload.op_builder``
  is the one name for it everywhere.
- The async-IO op's ``load()`` is made to return the DeepSpeed-shaped module (``deepoffload.io.compat``).

Both are cheap: the op builders import their parts on first use, and the wrapper imports torch only when it runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

OP_BUILDER = f"{__package__}.op_builder"


def op_builder() -> ModuleType:
    """``deepoffload.op_builder``: the installed one, else the checkout's ``op_builder/`` loaded under that name."""
    if OP_BUILDER in sys.modules:
        return sys.modules[OP_BUILDER]
    if importlib.util.find_spec(OP_BUILDER) is None:
        folder = Path(__file__).resolve().parent.parent / "op_builder"
        spec = None
        if (folder / "__init__.py").is_file():
            spec = importlib.util.spec_from_file_location(OP_BUILDER, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])
        if spec is None or spec.loader is None:
            raise ImportError(f"{OP_BUILDER} is not installed and there is no source checkout's op_builder/ at "
                              f"{folder}; reinstall deepoffload (pip install deepoffload, or pip install -e . in a "
                              f"checkout)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[OP_BUILDER] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[OP_BUILDER]
            raise
        return module
    return importlib.import_module(OP_BUILDER)


def _deepspeed_module(native: ModuleType):
    from .io.compat import CompatModule

    return CompatModule(native)


def link() -> None:
    op_builder().register_module_wrapper("async_io", _deepspeed_module)
