"""Strict import check of ``deepoffload/`` and ``op_builder/`` (standard library only).

Finds four kinds of violation, each printed as ``file:line: kind: message``:

- ``cycle``: an import circle, counting imports under ``if TYPE_CHECKING:`` and inside functions (a circle a type
  checker or a first call walks is still a circle in the design). One line per group of modules that import each
  other, naming the group and one circle through it with the file:line of each import
  (``[T]``: under TYPE_CHECKING, ``[f]``: inside a function).
- ``upward`` / ``sideways``: an import from a layer into a higher one, or into another part of the same layer
  (``LAYERS`` below is the table, lowest first).
- ``private``: an underscore name of one module used by another (``from .x import _y``, ``x._y`` on an imported
  module of the package; a package ``__init__`` counts as a module of its own). Dunder names and ``_`` are not
  private; underscore modules (``_lazy``, ``_ops``) are package-internal modules, not private names.
- ``swallow``: an ``except`` clause whose body only passes, continues, breaks or returns a constant or a name, with
  no ``raise``, and no comment on the except line, the line above or in the clause saying why.

Usage: ``python import_check.py <worktree-root> [--under deepoffload/io]``; exit status 1 when anything is found.
``op_builder/`` is checked as ``deepoffload.op_builder`` (the name it is installed under).
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

PACKAGES = {"deepoffload": "deepoffload", "op_builder": "deepoffload.op_builder"}  # folder -> module name

# Layers, lowest first: a module may import from its own part and from parts of lower layers only. Parts are module
# name prefixes (the longest that matches wins); parts in one layer are siblings that do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    # the op builder (imports nothing of deepoffload), the native op's stubs, leaf helpers
    ("deepoffload.op_builder", "deepoffload._ops", "deepoffload.version", "deepoffload._lazy", "deepoffload._link"),
    ("deepoffload.errors",),
    ("deepoffload.config", "deepoffload.pending"),
    ("deepoffload.io",),  # the Python IO handle, buffers, accelerator hooks
    ("deepoffload.diagnostics",),
    ("deepoffload.swap", "deepoffload.formats", "deepoffload.bench"),  # tensor/optimizer swapping; file formats
    ("deepoffload.checkpoint",),  # save/load of whole checkpoints, over formats
    ("deepoffload.dcp",),
    ("deepoffload.swap.params", "deepoffload.activations", "deepoffload.kv"),  # parameter, activation, KV streaming
    ("deepoffload.integrations",),  # DeepSpeed, Hugging Face
    ("deepoffload.demo",),
    ("deepoffload.cli",),
    ("deepoffload", "deepoffload.__main__"),  # the public facade (the package's own __init__ only)
)
WHOLE_MODULE_ONLY = {"deepoffload"}  # parts that name one module, not the package below it

KINDS = ("cycle", "upward", "sideways", "unlayered", "private", "swallow")


@dataclass(frozen=True)
class Violation:
    """One finding: ``path`` relative to the checked root, 1-based ``line``, one of ``KINDS``."""

    path: str
    line: int
    kind: str
    message: str
    modules: tuple[str, ...] = ()  # for a cycle: the group's modules

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.message}"


@dataclass(frozen=True)
class Edge:
    """One import of ``target`` (a module of the package) by ``importer``, at ``line``; ``where`` is ``"module"``,
    ``"function"`` or ``"type-checking"``; ``direct`` is False for a package ``__init__`` run on the way."""

    importer: str
    target: str
    line: int
    where: str
    direct: bool


def module_files(root: Path) -> dict[str, tuple[Path, bool]]:
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


def is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` test is ``TYPE_CHECKING`` (or ``typing.TYPE_CHECKING``)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def is_private(name: str) -> bool:
    """An underscore name that is neither ``_`` nor a dunder."""
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def import_statements(body: list[ast.stmt], where: str = "module"):
    """Every import statement in ``body`` with where it runs: ``"module"`` (when the module is imported),
    ``"function"`` (in a function, class body or under a function) or ``"type-checking"``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, where
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            yield from import_statements(node.body, "type-checking")
            yield from import_statements(node.orelse, where)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from import_statements(node.body, "function" if where == "module" else where)
        elif isinstance(node, ast.ClassDef):
            yield from import_statements(node.body, where)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from import_statements([child], where)
                elif isinstance(child, (ast.excepthandler, ast.match_case)):
                    yield from import_statements(child.body, where)


def _absolute(name: str) -> str:
    """``op_builder...`` as the package's ``deepoffload.op_builder...``."""
    return "deepoffload." + name if name == "op_builder" or name.startswith("op_builder.") else name


def _from_base(node: ast.ImportFrom, module: str, package: bool) -> str:
    if not node.level:
        return _absolute(node.module or "")
    base = module if package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def _parents_run(target: str, importer: str) -> set[str]:
    """``target`` and the packages above it, whose ``__init__`` runs first when ``importer`` imports ``target``;
    less the packages above ``importer`` (and ``importer`` itself), imported before ``importer`` runs."""
    parts, mine = target.split("."), importer.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - {
        ".".join(mine[:i]) for i in range(1, len(mine) + 1)
    }


class Package:
    """The parsed modules of a checkout and their imports."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules = module_files(root)
        self.trees = {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in self.modules.items()}

    def path(self, module: str) -> str:
        """The module's file, relative to the root."""
        return self.modules[module][0].relative_to(self.root).as_posix()

    def edges(self) -> list[Edge]:
        """Every import of a module of the package, with the package ``__init__`` files it runs on the way."""
        found = []
        for name, (_, package) in self.modules.items():
            for node, where in import_statements(self.trees[name].body):
                if isinstance(node, ast.Import):
                    targets = [_absolute(alias.name) for alias in node.names]
                else:
                    base = _from_base(node, name, package)
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in self.modules else base for a in node.names]
                for target in targets:
                    run = _parents_run(target, name)
                    if target != name and isinstance(node, ast.ImportFrom):
                        run.add(target)  # a name taken from a package above: its __init__ runs that import
                    for module in sorted(run):
                        if module in self.modules:
                            found.append(Edge(name, module, node.lineno, where, module == target))
        return found

    def graph(self, wheres: tuple[str, ...] = ("module", "function", "type-checking")) -> dict[str, set[str]]:
        """Module -> the modules it imports (with the ``__init__`` files run on the way) by imports in ``wheres``."""
        graph: dict[str, set[str]] = {name: set() for name in self.modules}
        for edge in self.edges():
            if edge.where in wheres:
                graph[edge.importer].add(edge.target)
        return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups (sorted, of two or more modules) in which every module reaches every other (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
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
    return groups


def one_cycle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A path through ``group`` that returns to where the circle closes (``[a, b, a]``)."""
    members = set(group)
    start = group[0]
    path, seen, node = [start], {start}, start
    while True:
        node = min(n for n in graph[node] if n in members)
        path.append(node)
        if node in seen:
            return path[path.index(node) :]
        seen.add(node)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per group of modules that import each other."""
    return [one_cycle(graph, group) for group in strongly_connected(graph)]


def check_cycles(package: Package) -> list[Violation]:
    """Import circles, counting every import."""
    first: dict[tuple[str, str], Edge] = {}
    for edge in package.edges():
        first.setdefault((edge.importer, edge.target), edge)
    graph = package.graph()
    found = []
    for group in strongly_connected(graph):
        cycle = one_cycle(graph, group)
        steps = [cycle[0]]
        for a, b in zip(cycle, cycle[1:]):
            edge = first[a, b]
            mark = {"module": "", "function": " [f]", "type-checking": " [T]"}[edge.where]
            steps.append(f"({Path(package.path(a)).name}:{edge.line}{mark}) {b}")
        opening = first[cycle[0], cycle[1]]
        found.append(
            Violation(
                package.path(cycle[0]),
                opening.line,
                "cycle",
                f"{len(group)} modules import each other: {', '.join(group)}; one circle: {' -> '.join(steps)}",
                tuple(group),
            )
        )
    return found


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer, part) of a module: the longest ``LAYERS`` prefix that names it or a package above it."""
    best = None
    for level, parts in enumerate(LAYERS):
        for part in parts:
            below = module.startswith(part + ".") and part not in WHOLE_MODULE_ONLY
            if (module == part or below) and (best is None or len(part) > len(best[1])):
                best = (level, part)
    return best


def check_layers(package: Package) -> list[Violation]:
    """Imports into a higher layer or a sibling part, and modules the table does not place."""
    found = []
    for module in package.modules:
        if layer_of(module) is None:
            found.append(Violation(package.path(module), 1, "unlayered", f"{module} is in no part of LAYERS"))
    seen = set()
    for edge in package.edges():
        mine, theirs = layer_of(edge.importer), layer_of(edge.target)
        if not edge.direct or mine is None or theirs is None or mine[1] == theirs[1]:
            continue
        if (edge.importer, edge.target, edge.line) in seen:
            continue
        seen.add((edge.importer, edge.target, edge.line))
        if theirs[0] > mine[0]:
            kind = "upward"
        elif theirs[0] == mine[0]:
            kind = "sideways"
        else:
            continue
        found.append(
            Violation(
                package.path(edge.importer),
                edge.line,
                kind,
                f"{edge.importer} (layer {mine[0]}, {mine[1]}) imports {edge.target} (layer {theirs[0]}, {theirs[1]})"
                + {"module": "", "function": " inside a function", "type-checking": " under TYPE_CHECKING"}[edge.where],
            )
        )
    return found


def _bound_modules(package: Package, name: str) -> dict[str, str]:
    """Local name -> module of the package, for the names ``name``'s imports bind to modules."""
    bound = {}
    package_init = package.modules[name][1]
    for node, _ in import_statements(package.trees[name].body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                full = _absolute(alias.name)
                if alias.asname and full in package.modules:
                    bound[alias.asname] = full
                elif not alias.asname:
                    top = alias.name.partition(".")[0]
                    if _absolute(alias.name) in package.modules:
                        bound[top] = _absolute(top)
        else:
            base = _from_base(node, name, package_init)
            for alias in node.names:
                if f"{base}.{alias.name}" in package.modules:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return bound


def check_private(package: Package) -> list[Violation]:
    """Underscore names of one module imported or read by another."""
    found = []
    for name, (_, package_init) in package.modules.items():
        tree = package.trees[name]
        for node, _ in import_statements(tree.body):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _from_base(node, name, package_init)
            if base not in package.modules or base == name:
                continue
            for alias in node.names:
                if is_private(alias.name) and f"{base}.{alias.name}" not in package.modules:
                    found.append(
                        Violation(package.path(name), node.lineno, "private", f"imports {alias.name} from {base}")
                    )
        bound = _bound_modules(package, name)
        if not bound:
            continue

        def module_at(node: ast.expr) -> str | None:
            if isinstance(node, ast.Name):
                return bound.get(node.id)
            if isinstance(node, ast.Attribute):
                parent = module_at(node.value)
                if parent is not None and f"{parent}.{node.attr}" in package.modules:
                    return f"{parent}.{node.attr}"
            return None

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                owner = module_at(node.value)
                if owner in package.modules and owner != name and f"{owner}.{node.attr}" not in package.modules:
                    found.append(Violation(package.path(name), node.lineno, "private", f"reads {node.attr} of {owner}"))
    return found


def _comment_lines(text: str) -> set[int]:
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
    return lines


def _does_nothing(statement: ast.stmt) -> bool:
    if isinstance(statement, (ast.Pass, ast.Continue, ast.Break)):
        return True
    if isinstance(statement, ast.Return):
        return statement.value is None or isinstance(statement.value, (ast.Constant, ast.Name))
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)


def check_excepts(package: Package) -> list[Violation]:
    """``except`` clauses that swallow the error without a comment saying why."""
    found = []
    for name, (path, _) in package.modules.items():
        comments = None
        for node in ast.walk(package.trees[name]):
            if not isinstance(node, ast.ExceptHandler):
                continue
            if any(isinstance(n, ast.Raise) for n in ast.walk(node)) or not all(map(_does_nothing, node.body)):
                continue
            if comments is None:
                comments = _comment_lines(path.read_text())
            last = max(node.lineno + 1, node.end_lineno or node.lineno)
            if not any(line in comments for line in range(node.lineno - 1, last + 1)):
                caught = ast.unparse(node.type) if node.type is not None else "everything"
                body = "; ".join(ast.unparse(s) for s in node.body)
                found.append(
                    Violation(package.path(name), node.lineno, "swallow", f"except {caught}: {body} (no comment why)")
                )
    return found


def check(root: Path, under: str | None = None) -> list[Violation]:
    """Every violation in the checkout at ``root`` (only those in files under ``under``, a path relative to the
    root, when given; a cycle is kept when one of its modules is there), sorted by file and line."""
    package = Package(root)
    found = check_cycles(package) + check_layers(package) + check_private(package) + check_excepts(package)
    if under:
        prefix = Path(under).as_posix().rstrip("/")

        def inside(path: str) -> bool:
            return path == prefix or path.startswith(prefix + "/")

        found = [v for v in found if inside(v.path) or any(inside(package.path(m)) for m in v.modules)]
    return sorted(set(found), key=lambda v: (v.path, v.line, v.kind, v.message))


def main(argv: list[str] | None = None) -> int:
    """Print the violations of a checkout; 1 when there are any, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the worktree's root (holding deepoffload/ and op_builder/)")
    parser.add_argument("--under", help="only files under this path, relative to the root (e.g. deepoffload/io)")
    args = parser.parse_args(argv)
    if not (args.root / "deepoffload").is_dir():
        parser.error(f"{args.root} holds no deepoffload/ folder")
    found = check(args.root.resolve(), args.under)
    for violation in found:
        print(violation)
    counts = {kind: sum(v.kind == kind for v in found) for kind in KINDS}
    print(f"{len(found)} violations: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()), file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
