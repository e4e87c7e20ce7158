"""One error family: every exception class deepoffload defines is a ``DeepOffloadError``, and the library raises no
built-in exception that says nothing a caller can act on.

The rule, checked statically over every module of ``deepoffload/`` and ``op_builder/``: no code constructs or raises
``Exception``, ``BaseException``, ``RuntimeError``, ``AssertionError``, ``EnvironmentError``, ``IOError`` or
``MemoryError`` (a limit the caller set is not the interpreter running out of memory; raised
at once or built to be raised later). Each such error has a class of the family instead (``deepoffload.errors``, or
``op_builder``'s ``BuildError`` and ``EnvError``), which names what went wrong and keeps the built-in base that
existing ``except`` clauses use (``StreamedParameterError`` is a ``RuntimeError``). Built-in types that carry a
meaning callers dispatch on stay allowed: ``OSError`` and its subclasses with an errno, ``ValueError`` and
``TypeError`` for bad arguments (as the standard library raises them), ``KeyError``, ``IndexError``,
``AttributeError``, ``StopIteration`` and ``NotImplementedError`` for their protocols, ``TimeoutError`` from a wait,
``ImportError`` for a missing optional dependency, ``SystemExit`` from the command line's entry point.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "Exception",
    "BaseException",
    "RuntimeError",
    "AssertionError",
    "EnvironmentError",
    "IOError",
    "MemoryError",
}


def library_files() -> list[Path]:
    return sorted(
        p
        for folder in ("deepoffload", "op_builder")
        for p in (ROOT / folder).rglob("*.py")
        if not (p.is_relative_to(ROOT / "deepoffload" / "op_builder"))
    )


def generic_errors(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each construction (``Name(...)``) or bare ``raise Name`` of a forbidden built-in."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN:
            found.append((node.lineno, node.func.id))
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Name) and node.exc.id in FORBIDDEN:
            found.append((node.lineno, node.exc.id))
    return sorted(found)


def test_the_scan_finds_generic_errors():
    source = (
        "def f(x):\n    if x:\n        raise RuntimeError('a')\n    if x > 1:\n        raise Exception\n"
        "    error = AssertionError('later')\n    raise ValueError(x) from error\n"
    )
    assert generic_errors(ast.parse(source)) == [(3, "RuntimeError"), (5, "Exception"), (6, "AssertionError")]


def test_no_generic_builtin_error_is_raised():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in library_files()
        for line, name in generic_errors(ast.parse(path.read_text()))
    ]
    assert not found, (
        "raise a class of deepoffload.errors (keeping the built-in base, e.g. UnsupportedError for a "
        "refused pattern) instead of:\n" + "\n".join(found)
    )


def defined_exceptions() -> list[tuple[str, str]]:
    """(module, class) of each public module-level class whose bases name an error or exception."""
    found = []
    for path in library_files():
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[0] == "op_builder":
            parts = ("deepoffload", *parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.ClassDef)
                and not node.name.startswith("_")
                and any(
                    (getattr(base, "id", None) or getattr(base, "attr", "")).endswith(("Error", "Exception"))
                    for base in node.bases
                )
            ):
                found.append((module, node.name))
    return found


def test_defined_exceptions_are_found():
    found = set(defined_exceptions())
    assert {
        ("deepoffload.errors", "StreamedParameterError"),
        ("deepoffload.op_builder.build_errors", "BuildError"),
        ("deepoffload.op_builder.env", "EnvError"),
        ("deepoffload.formats.torch_zip.zip_crc", "ZipLayoutError"),
        ("deepoffload.op_builder.errors", "DeepOffloadError"),
    } <= found


@pytest.mark.parametrize("module, name", defined_exceptions())
def test_every_defined_exception_is_in_the_family(module, name):
    from deepoffload.errors import DeepOffloadError

    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, DeepOffloadError), f"{module}.{name} must derive from DeepOffloadError"


def test_the_family_keeps_the_builtin_bases_callers_catch():
    from deepoffload.op_builder.build_errors import BuildError
    from deepoffload.op_builder.env import EnvError
    from deepoffload.op_builder.errors import DeepOffloadError as base

    import deepoffload
    from deepoffload.errors import (
        CheckpointError,
        CheckpointNotFoundError,
        DeepOffloadError,
        StreamedParameterError,
        UnsupportedError,
    )
    from deepoffload.formats.torch_zip.zip_crc import ZipLayoutError

    assert DeepOffloadError is base is deepoffload.DeepOffloadError  # one base, also below deepoffload's layers
    assert deepoffload.BuildError is BuildError
    for cls, builtin in [
        (BuildError, RuntimeError),
        (EnvError, ValueError),
        (ZipLayoutError, RuntimeError),
        (UnsupportedError, RuntimeError),
        (StreamedParameterError, RuntimeError),
        (CheckpointError, ValueError),
        (CheckpointNotFoundError, FileNotFoundError),  # what a missing file raises in safetensors and torch.load
    ]:
        assert issubclass(cls, DeepOffloadError) and issubclass(cls, builtin), cls
    assert issubclass(StreamedParameterError, UnsupportedError)
    assert issubclass(CheckpointNotFoundError, CheckpointError)
    missing = CheckpointNotFoundError(2, "no such checkpoint file", "model.safetensors")
    assert (missing.errno, missing.strerror, missing.filename) == (2, "no such checkpoint file", "model.safetensors")


def test_a_bad_environment_variable_is_a_deepoffload_error(monkeypatch):
    from deepoffload.op_builder import env

    from deepoffload.errors import DeepOffloadError

    monkeypatch.setenv("DEEPOFFLOAD_BUILD_AIO", "maybe")
    with pytest.raises(DeepOffloadError, match="DEEPOFFLOAD_BUILD_AIO"):
        env.get("DEEPOFFLOAD_BUILD_AIO")
