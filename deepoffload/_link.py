"""``deepoffload.op_builder`` everywhere, also in a source checkout used without installing.

There, ``op_builder/`` beside this package is loaded under that name (an installed or editable package maps it there
already). Cheap: the op builders import their parts on first use. (The async-IO op's ``load()`` wraps its native
module in the DeepSpeed-shaped ``deepoffload.io.compat.CompatModule`` itself, by name: ``AsyncIOBuilder.WRAPPER``.)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

OP_BUILDER = f"{__package__}.op_builder"


def op_builder() -> ModuleType:
    """``deepoffload.op_builder``: the installed one, else the checkout's ``op_builder/`` loaded under that name.

    Returns:
        The module.

    Raises:
        ImportError: When it is not installed and there is no checkout's ``op_builder/`` beside this package.
    """
    if OP_BUILDER in sys.modules:
        return sys.modules[OP_BUILDER]
    if importlib.util.find_spec(OP_BUILDER) is None:
        folder = Path(__file__).resolve().parent.parent / "op_builder"
        spec = None
        if (folder / "__init__.py").is_file():
            spec = importlib.util.spec_from_file_location(
                OP_BUILDER, folder / "__init__.py", submodule_search_locations=[str(folder)]
            )
        if spec is None or spec.loader is None:
            raise ImportError(
                f"{OP_BUILDER} is not installed and there is no source checkout's op_builder/ at "
                f"{folder}; reinstall deepoffload (pip install deepoffload, or pip install -e . in a "
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
    return importlib.import_module(OP_BUILDER)
