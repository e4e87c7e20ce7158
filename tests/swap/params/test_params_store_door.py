"""``BlockStore`` is the only door from ``swap/params`` to the swapper: no other module there names a
``TensorSwapper`` or reaches through a store (or through itself) to one; each goes through the store's methods
(``write_masters``, ``serve``, ``read_grads``, ``write_grads``, ``discard_grads``, counters, ``close``)."""

from __future__ import annotations

import ast
from pathlib import Path

PARAMS = Path(__file__).resolve().parents[3] / "deepoffload" / "swap" / "params"


def reaches_past_the_store(tree: ast.AST) -> list[int]:
    """Lines that import ``TensorSwapper`` or read ``.swapper`` of ``self``, ``store`` or ``self.store``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "TensorSwapper" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "swapper":
            owner = ast.unparse(node.value)
            if owner in ("self", "store", "self.store"):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_check_sees_a_reach_past_the_store():
    source = (
        "from ..tensor_swapper import TensorSwapper\n"
        "def f(self, store, optimizer):\n"
        "    store.swapper.close(); self.store.swapper.discard('g'); self.swapper.records('g')\n"
        "    return optimizer.swapper.bytes_read\n"
    )
    assert reaches_past_the_store(ast.parse(source)) == [1, 3, 3, 3]


def test_only_the_block_store_holds_the_swapper():
    found = [
        f"{path.name}:{line}"
        for path in sorted(PARAMS.glob("*.py"))
        if path.name != "store.py"
        for line in reaches_past_the_store(ast.parse(path.read_text()))
    ]
    assert not found, "go through BlockStore's methods instead: " + ", ".join(found)
