"""Layers only look down: ``op_builder`` imports nothing from ``deepoffload``, so the top-level ``op_builder`` of a
source checkout (as ``setup.py`` imports it), the installed ``deepoffload.op_builder`` and a checkout used without
installing all import and load the op (each in a child process, sharing the session's build cache)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Drops the editable install's import hook, so only sys.path (the checkout) provides deepoffload.
NO_EDITABLE = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"


def child(code: str, *, cwd: Path = ROOT) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_op_builder_imports_nothing_from_deepoffload():
    for path in sorted((ROOT / "op_builder").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name}:{node.lineno} imports above op_builder"
                assert not (node.module or "").startswith("deepoffload"), f"{path.name}:{node.lineno}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("deepoffload") for a in node.names), f"{path.name}:{node.lineno}"


def test_op_builder_exports_resolve():
    out = child(
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "import op_builder\n"
        "print([n for n in op_builder.__all__ if getattr(op_builder, n, None) is None])\n"
    )
    assert out.strip() == "[]"


def test_top_level_op_builder_of_a_checkout_loads_the_deepspeed_shaped_module_too():
    """One type from ``load()`` whichever package came first: the checkout's plain ``op_builder`` imports nothing
    from deepoffload until an op is loaded, then wraps it as ``deepoffload.op_builder`` does."""
    out = child(
        NO_EDITABLE + f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import op_builder\n"
        "before = any(k == 'deepoffload' or k.startswith('deepoffload.') for k in sys.modules)\n"
        "m = op_builder.AsyncIOBuilder().load()\n"
        "native = op_builder.AsyncIOBuilder().load_native()\n"
        "print(op_builder.__file__, type(m).__name__, type(native).__name__, 'posix' in native.engines(),\n"
        "      before)\n"
    )
    path, kind, native_kind, has_posix, imported_before = out.split()
    assert path == str(ROOT / "op_builder" / "__init__.py")
    assert (kind, native_kind, has_posix, imported_before) == ("CompatModule", "module", "True", "False")


def test_installed_op_builder_loads_the_deepspeed_shaped_module(tmp_path):
    out = child(
        "from deepoffload.op_builder import AsyncIOBuilder\n"
        "m = AsyncIOBuilder().load()\n"
        "print(type(m).__name__, type(m.aio_handle()).__name__, type(AsyncIOBuilder().load_native()).__name__)",
        cwd=tmp_path,
    )
    assert out.split() == ["CompatModule", "aio_handle", "module"]


def test_checkout_without_install_has_deepoffload_op_builder():
    out = child(
        NO_EDITABLE + f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import deepoffload, deepoffload.op_builder as ob\n"
        "print(deepoffload.__file__, ob.__file__, type(ob.AsyncIOBuilder().load()).__name__)\n"
    )
    package, builder, kind = out.split()
    assert package == str(ROOT / "deepoffload" / "__init__.py")
    assert builder == str(ROOT / "op_builder" / "__init__.py")
    assert kind == "CompatModule"


@pytest.mark.parametrize("name", ["op_builder", "deepoffload.op_builder"])
def test_version_read_by_op_builder_is_the_package_version(name):
    out = child(
        NO_EDITABLE + f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"import importlib; b = importlib.import_module({name + '.builder'!r})\n"
        "from deepoffload.version import __version__\n"
        "print(b.package_version() == __version__)\n"
    )
    assert out.strip() == "True"


# One module and one BuildError, whichever name comes first: ``except op_builder.BuildError`` catches what
# ``deepoffload.op_builder`` raises (and the other way round), and a submodule is one module under both names.
ONE_MODULE = (
    "import op_builder, deepoffload.op_builder as ob\n"
    "from op_builder.build_errors import BuildError as E1\n"
    "from deepoffload.op_builder.build_errors import BuildError as E2\n"
    "from deepoffload.op_builder import env\n"
    "import op_builder.env\n"
    "try:\n"
    "    raise ob.BuildError('async_io', ['a reason'], 'a hint')\n"
    "except op_builder.BuildError as e:\n"
    "    caught = type(e) is E1\n"
    "print(ob is op_builder, E1 is E2 is ob.BuildError is op_builder.BuildError, env is op_builder.env, caught,\n"
    "      ob.__file__, ob.__spec__.name == ob.__name__)\n"
)


def _one_module(out: str) -> None:
    *same, path, spec_kept = out.split()
    assert same == ["True"] * 4
    assert path == str(ROOT / "op_builder" / "__init__.py") and spec_kept == "True"


@pytest.mark.parametrize("first", ["deepoffload", "op_builder"])
def test_a_bare_checkout_has_one_op_builder_and_one_build_error(first):
    out = child(NO_EDITABLE + f"sys.path.insert(0, {str(ROOT)!r})\nimport {first}\n" + ONE_MODULE)
    _one_module(out)


def _editable_finder() -> str:
    """The source of this environment's editable-install finder of deepoffload, made to point at this checkout."""
    for folder in map(Path, sys.path):
        for path in sorted(folder.glob("__editable___deepoffload_*_finder.py")) if folder.is_dir() else []:
            namespace: dict = {}
            exec(compile(path.read_text(), str(path), "exec"), namespace)  # only definitions and its MAPPING
            installed_root = str(Path(namespace["MAPPING"]["deepoffload"]).parent)
            return path.read_text().replace(repr(installed_root)[1:-1] + "/", str(ROOT) + "/")
    pytest.skip("deepoffload is not installed editable here (pip install -e .)")


@pytest.mark.parametrize("first", ["deepoffload", "op_builder"])
def test_an_editable_install_run_from_its_checkout_has_one_op_builder(first):
    """setuptools' own finder maps ``deepoffload.op_builder`` to the checkout's op_builder/; from the checkout's root
    ``import op_builder`` finds the same folder on sys.path."""
    source = _editable_finder()
    out = child(
        NO_EDITABLE + "import importlib.util, types\n"
        f"finder = types.ModuleType('editable_finder'); exec({source!r}, finder.__dict__); finder.install()\n"
        "spec = importlib.util.find_spec('deepoffload.op_builder')\n"
        f"assert spec is not None and spec.origin == {str(ROOT / 'op_builder' / '__init__.py')!r}, spec\n"
        f"import {first}\n" + ONE_MODULE
    )
    _one_module(out)
