"""Library code never relies on ``assert`` or ``__debug__``: both vanish under ``python -O``. Checked statically
over every module of the package and the op builder, so it holds for code paths no test reaches."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def offenders() -> list[str]:
    found = []
    for path in sorted([*(ROOT / "deepoffload").rglob("*.py"), *(ROOT / "op_builder").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert) or (isinstance(node, ast.Name) and node.id == "__debug__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_library_code_has_no_assert_or_debug_branches():
    assert offenders() == []


def test_the_check_finds_an_assert(tmp_path):
    tree = ast.parse("def f(x):\n    assert x > 0\n    if __debug__:\n        pass\n")
    kinds = [
        type(n).__name__
        for n in ast.walk(tree)
        if isinstance(n, ast.Assert) or (isinstance(n, ast.Name) and n.id == "__debug__")
    ]
    assert kinds == ["Assert", "Name"]
