"""The public API: a cheap import; every lazily imported name resolves, is in ``__all__`` and is visible to type
checkers (the ``if TYPE_CHECKING:`` imports list the same names); every exception shares one base and keeps its
built-in type."""

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

LAZY_PACKAGES = ["deepoffload", "deepoffload.io", "deepoffload.formats"]


def type_checking_names(package: str) -> set[str]:
    """Names bound by the imports inside the package's ``if TYPE_CHECKING:`` block."""
    tree = ast.parse(Path(importlib.util.find_spec(package).origin).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                names.update(alias.asname or alias.name for alias in stmt.names)
    return names


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_lazy_names_resolve_and_are_all_exported(package):
    # a fresh process: each name must import on first access, not because another test imported its module
    code = (
        f"import {package} as p\n"
        "missing = [n for n in p.__all__ if getattr(p, n, None) is None]\n"
        "print(len(p.__all__), missing)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert int(out[0]) > 0 and out[1].strip() == "[]"
    module = importlib.import_module(package)
    assert sorted(set(module.__all__)) == sorted(module.__all__), "a name is exported twice"
    assert type_checking_names(package) == set(module.__all__) - {"__version__"}
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def test_import_is_cheap():
    """`import deepoffload` probes, compiles and loads nothing, and does not import torch: of the op builders only
    the package is imported (as ``deepoffload.op_builder``), not its builder or probes."""
    code = (
        "import sys, deepoffload; print('torch' in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith('deepoffload.op_builder')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split(" ", 1) == ["False", "['deepoffload.op_builder']\n"]


def test_returned_and_raised_types_are_exported():
    import deepoffload

    for name in ("SwapIn", "SwapOut", "Request", "BuildError", "DeepOffloadError", "ClosedError", "ChecksumError"):
        assert name in deepoffload.__all__


def test_exceptions_share_one_base_and_keep_their_builtin_type():
    import deepoffload
    from deepoffload import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), deepoffload.DeepOffloadError), name
    for name, builtin in [
        ("ChecksumError", OSError),
        ("ValidationError", OSError),
        ("ConfigError", ValueError),
        ("CheckpointError", ValueError),
        ("ClosedError", ValueError),
        ("ClosedError", RuntimeError),
        ("ResidencyError", RuntimeError),
        ("UnsupportedError", RuntimeError),
        ("StreamedParameterError", RuntimeError),
        ("MemoryBudgetError", MemoryError),
    ]:
        assert issubclass(getattr(errors, name), builtin), name
    # the names the modules raised them from before still refer to the same classes
    from deepoffload.config import ConfigError
    from deepoffload.formats.header import CheckpointError
    from deepoffload.io.handle import ValidationError
    from deepoffload.swap.tensor_swapper import ChecksumError

    assert (ConfigError, CheckpointError, ValidationError, ChecksumError) == (
        errors.ConfigError,
        errors.CheckpointError,
        errors.ValidationError,
        errors.ChecksumError,
    )


def test_use_after_close_raises_closed_error(tmp_path):
    import torch

    from deepoffload import AsyncIOHandle, ClosedError, SwapConfig, TensorSwapper

    handle = AsyncIOHandle()
    handle.close()
    with pytest.raises(ClosedError, match="closed"):
        handle.write(torch.zeros(4), str(tmp_path / "f"))
    swapper = TensorSwapper(SwapConfig(folder=str(tmp_path)))
    swapper.close()
    with pytest.raises(ClosedError, match="closed"):
        swapper.swap_out({"g": {"t": torch.zeros(4)}})
