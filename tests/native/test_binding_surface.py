"""The native module's type stub (deepoffload/_ops/deepoffload_aio.pyi) names exactly what the built module exports,
with the same argument names, and the defaults the binding exports are the ones the Python config uses."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
STUB = REPO / "deepoffload" / "_ops" / "deepoffload_aio.pyi"


@pytest.fixture(scope="module")
def module():
    from deepoffload.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load_native()


@pytest.fixture(scope="module")
def stub() -> ast.Module:
    return ast.parse(STUB.read_text())


def public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def stub_names(body: list[ast.stmt]) -> set[str]:
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return public(names)


def stub_class(stub: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == name)


def stub_args(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.args if a.arg != "self"]


def native_args(fn) -> list[str]:
    """Argument names from pybind11's signature line, e.g. ``submit(self: m.Handle, write: bool, ...) -> int``."""
    signature = fn.__doc__.strip().splitlines()[0]
    inside = signature[signature.index("(") + 1 : signature.rindex(")")]
    return [n for n in re.findall(r"(?:^|, )(\w+):", inside) if n != "self"]


def test_stub_names_the_module_attributes(module, stub):
    assert stub_names(stub.body) == public(n for n in dir(module) if not n.startswith("__"))


def test_stub_names_the_handle_members(module, stub):
    handle = stub_class(stub, "Handle")
    named = {n.name for n in handle.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("__")}
    assert named == public(dir(module.Handle))


def test_stub_argument_names_match(module, stub):
    functions = {n.name: n for n in stub.body if isinstance(n, ast.FunctionDef)}
    for name, fn in functions.items():
        assert stub_args(fn) == native_args(getattr(module, name)), name
    for fn in stub_class(stub, "Handle").body:
        if isinstance(fn, ast.FunctionDef) and not any(
            isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list
        ):
            assert stub_args(fn) == native_args(getattr(module.Handle, fn.name)), f"Handle.{fn.name}"


def test_stub_dict_keys_match(module, stub):
    def keys(class_name: str) -> set[str]:
        return {n.target.id for n in stub_class(stub, class_name).body if isinstance(n, ast.AnnAssign)}

    assert keys("_Defaults") == set(module.DEFAULTS)
    assert keys("_Features") == set(module.build_features())


def test_exported_defaults_are_the_configs(module):
    """One set of defaults: C++ writes them; the Python config (which must work before the op is built) agrees."""
    from deepoffload.config import AioConfig

    for key, value in module.DEFAULTS.items():
        if key != "engine":  # Python's default is "auto": the best engine whose self-test passes
            assert getattr(AioConfig, key) == value, key
    handle = module.Handle()
    try:
        assert {k: getattr(handle, k) for k in module.DEFAULTS} == module.DEFAULTS
    finally:
        handle.close()
    assert module.DEFAULTS["engine"] == module.engines()[-1]


def test_stub_ships_as_package_data():
    setup = (REPO / "setup.py").read_text()
    assert re.search(r'"deepoffload\._ops": \[[^\]]*"deepoffload_aio\.pyi"', setup)
