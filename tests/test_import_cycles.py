"""No import cycle among the modules of ``deepoffload/`` and ``op_builder/`` (module-level imports; those under
``if TYPE_CHECKING:`` and inside functions are not run at import and are left out), and none even through the
imports functions make on first use. Checked statically over the import graph, so it holds for modules no
test imports. ``op_builder`` is imported as ``deepoffload.op_builder``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"deepoffload": "deepoffload", "op_builder": "deepoffload.op_builder"}  # folder -> module name


def module_files(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Module name -> (its file, whether it is a package's ``__init__``)."""
    found = {}
    for folder, name in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            package = parts[-1] == "__init__"
            if package:
                parts.pop()
            found[".".join([name, *parts])] = (path, package)
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt]):
    """The import statements a module runs when imported: at top level and in its top-level if/try blocks, not in
    functions, classes or ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _module_level_imports(block)


def _all_imports(body: list[ast.stmt]):
    """Every import statement a module may run, in functions too, except under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _type_checking(node.test):
            yield from _all_imports(node.orelse)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _all_imports([child])
                elif isinstance(child, ast.excepthandler):
                    yield from _all_imports(child.body)


def _run_by_importing(target: str, importer: str) -> set[str]:
    """``target`` and the packages above it, whose ``__init__`` runs first when ``importer`` imports ``target``;
    less the packages above ``importer`` (and ``importer`` itself), imported before ``importer`` runs."""
    parts, mine = target.split("."), importer.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - {
        ".".join(mine[:i]) for i in range(1, len(mine) + 1)
    }


def import_graph(modules: dict[str, tuple[Path, bool]], in_functions: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports at module level (``in_functions``: anywhere). ``from P
    import n`` imports ``P.n`` when that is a module, else ``P``; importing a module also runs the ``__init__`` of
    each package above it that is not above the importer."""
    graph: dict[str, set[str]] = {}
    imports = _all_imports if in_functions else _module_level_imports
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        edges = graph[name] = set()
        for node in imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = here
                for _ in range(node.level - 1 if node.level else 0):
                    base = base.rpartition(".")[0]
                base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges.update(m for t in targets for m in _run_by_importing(t, name) if m in modules)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected group of modules that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative (deep graphs would exhaust recursion)
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return [_cycle_in(graph, set(group)) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    start = min(group)
    path, seen, node = [start], {start}, start
    while True:
        node = min(n for n in graph[node] if n in group)
        path.append(node)
        if node in seen:
            return path[path.index(node) :]
        seen.add(node)


def test_every_module_is_in_the_graph():
    modules = module_files()
    assert {
        "deepoffload.io.handle",
        "deepoffload.io.staging",
        "deepoffload.op_builder.builder",
        "deepoffload.swap.params.offload",
    } <= set(modules)
    graph = import_graph(modules)
    assert (
        "deepoffload.io.handle" in graph["deepoffload.io.staging"]
        or "deepoffload.io.inputs" in graph["deepoffload.io.staging"]
    )
    assert "deepoffload.op_builder.builder" in graph["deepoffload.op_builder.async_io"]


def test_no_import_cycle():
    found = cycles(import_graph(module_files()))
    assert found == [], "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_import_cycle_even_through_imports_on_first_use():
    """E.g. ``handle`` imports ``staging`` when a device tensor first needs it: ``staging`` and ``staged_file`` take
    their shared helpers from ``inputs``, not from ``handle``; ``op_builder``'s lazy names import ``builder``, which
    imports ``deepoffload.io.compat`` only by name when an op is loaded."""
    found = cycles(import_graph(module_files(), in_functions=True))
    assert found == [], "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            {"deepoffload/io/a.py": "from .b import x\n", "deepoffload/io/b.py": "from . import a\n"},
            [["deepoffload.io.a", "deepoffload.io.b", "deepoffload.io.a"]],
        ),
        (
            {
                "deepoffload/a.py": "import deepoffload.c\n",
                "deepoffload/c.py": "try:\n    from .a import y\nexcept ImportError:\n    pass\n",
            },
            [["deepoffload.a", "deepoffload.c", "deepoffload.a"]],
        ),
        (
            {
                "deepoffload/x/__init__.py": "from ..op_builder import builder\n",
                "op_builder/builder.py": "from deepoffload.x import thing\n",
            },
            [["deepoffload.op_builder.builder", "deepoffload.x", "deepoffload.op_builder.builder"]],
        ),
        (  # importing p.c runs p's __init__ first, which imports p.a, which imports m (still importing): a cycle
            {
                "deepoffload/p/__init__.py": "from .a import A\n",
                "deepoffload/p/a.py": "from ..m import M\nA = 1\n",
                "deepoffload/p/c.py": "C = 1\n",
                "deepoffload/m.py": "from .p.c import C\nM = 1\n",
            },
            [["deepoffload.m", "deepoffload.p", "deepoffload.p.a", "deepoffload.m"]],
        ),
        (
            {
                "deepoffload/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
                "deepoffload/b.py": "from .a import A\ndef f():\n    from .a import g\n",
            },
            [],
        ),
    ],
)
def test_the_check_finds_a_cycle(tmp_path, files, expected):
    write(tmp_path, files)
    assert cycles(import_graph(module_files(tmp_path))) == expected


def test_the_check_in_functions_finds_a_cycle_through_a_lazy_import(tmp_path):
    write(
        tmp_path,
        {
            "deepoffload/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
            "class A:\n    def f(self):\n        from .b import g\n",
            "deepoffload/b.py": "from .a import A\n",
        },
    )
    modules = module_files(tmp_path)
    assert cycles(import_graph(modules)) == []
    assert cycles(import_graph(modules, in_functions=True)) == [["deepoffload.a", "deepoffload.b", "deepoffload.a"]]
