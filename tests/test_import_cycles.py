"""The import structure of ``deepoffload/`` and ``op_builder/``, checked statically (so it holds for modules no test
imports) by ``tests/support/import_check.py``, which also runs alone on any checkout:

- no import circle, counting imports under ``if TYPE_CHECKING:`` and inside functions;
- no import into a higher layer or a sibling part of the same layer (the layer table is ``LAYERS`` there), and no
  module the table does not place;
- no underscore name of one module imported or read by another;
- no ``except`` clause that swallows an error without a comment saying why.

``op_builder`` is checked as ``deepoffload.op_builder``, the name it is installed under."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.import_check import LAYERS, Package, check, cycles, layer_of

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "tests" / "support" / "import_check.py"


def found(kinds: tuple[str, ...], root: Path = ROOT) -> list[str]:
    return [str(v) for v in check(root) if v.kind in kinds]


def test_every_module_is_in_the_graph():
    package = Package(ROOT)
    assert {
        "deepoffload.io.handle",
        "deepoffload.op_builder.builder",
        "deepoffload.swap.params",
    } <= set(package.modules)
    graph = package.graph(("module",))
    assert "deepoffload.op_builder.builder" in graph["deepoffload.op_builder.async_io"]
    assert all(layer_of(name) is not None for name in package.modules)


def test_no_import_cycle():
    cycles_found = found(("cycle",))
    assert cycles_found == [], "\n".join(cycles_found)


def test_no_import_runs_up_a_layer():
    layers = found(("upward", "sideways", "unlayered"))
    assert layers == [], "\n".join(layers)


def test_no_private_name_is_used_across_modules():
    private = found(("private",))
    assert private == [], "\n".join(private)


def test_no_error_is_swallowed_without_a_comment():
    swallowed = found(("swallow",))
    assert swallowed == [], "\n".join(swallowed)


def test_architecture_names_every_part_of_the_layer_table():
    """ARCHITECTURE.md's table of layers is this one: each part of ``LAYERS`` is named there as a folder or file."""
    text = (ROOT / "ARCHITECTURE.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    for part in (p for parts in LAYERS for p in parts):
        folder = "op_builder" if part == "deepoffload.op_builder" else part.replace(".", "/")
        leaf = "__init__" if part == "deepoffload" else part.rpartition(".")[2]
        assert f"`{folder}/`" in text or f"{leaf}.py`" in text, f"ARCHITECTURE.md's layers do not name {part}"


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "files, at_import, everywhere",
    [
        (
            {"deepoffload/io/a.py": "from .b import x\n", "deepoffload/io/b.py": "from . import a\n"},
            [["deepoffload.io.a", "deepoffload.io.b", "deepoffload.io.a"]],
            [["deepoffload.io.a", "deepoffload.io.b", "deepoffload.io.a"]],
        ),
        (
            {
                "deepoffload/a.py": "import deepoffload.c\n",
                "deepoffload/c.py": "try:\n    from .a import y\nexcept ImportError:\n    pass\n",
            },
            [["deepoffload.a", "deepoffload.c", "deepoffload.a"]],
            [["deepoffload.a", "deepoffload.c", "deepoffload.a"]],
        ),
        (
            {
                "deepoffload/x/__init__.py": "from ..op_builder import builder\n",
                "op_builder/builder.py": "from deepoffload.x import thing\n",
            },
            [["deepoffload.op_builder.builder", "deepoffload.x", "deepoffload.op_builder.builder"]],
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
            [["deepoffload.m", "deepoffload.p", "deepoffload.p.a", "deepoffload.m"]],
        ),
        (  # not run at import, but a circle in the design all the same
            {
                "deepoffload/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
                "deepoffload/b.py": "from .a import A\ndef f():\n    from .a import g\n",
            },
            [],
            [["deepoffload.a", "deepoffload.b", "deepoffload.a"]],
        ),
        (
            {
                "deepoffload/a.py": "class A:\n    def f(self):\n        from .b import g\n",
                "deepoffload/b.py": "from .a import A\n",
            },
            [],
            [["deepoffload.a", "deepoffload.b", "deepoffload.a"]],
        ),
        (  # a name taken from the package's own __init__, which imports the taker for the type checker
            {
                "deepoffload/io/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from .handle import H\nLIMIT = 1\n",
                "deepoffload/io/handle.py": "from . import LIMIT\n",
            },
            [],
            [["deepoffload.io", "deepoffload.io.handle", "deepoffload.io"]],
        ),
    ],
)
def test_the_check_finds_a_cycle(tmp_path, files, at_import, everywhere):
    write(tmp_path, files)
    package = Package(tmp_path)
    assert cycles(package.graph(("module",))) == at_import
    assert cycles(package.graph()) == everywhere
    assert [list(v.modules) for v in check(tmp_path) if v.kind == "cycle"] == [sorted(set(c)) for c in everywhere]


def test_the_check_finds_imports_up_a_layer(tmp_path):
    write(
        tmp_path,
        {
            "deepoffload/io/a.py": "from typing import TYPE_CHECKING\n"
            "from ..errors import E\n"  # down: fine
            "from . import b\n"  # same part: fine
            "if TYPE_CHECKING:\n    from ..swap.t import T\n"  # up, even only for the type checker
            "def f():\n    from ..checkpoint import api\n",  # up, even on first use
            "deepoffload/io/b.py": "from .. import AsyncIOHandle\n",  # up: a name of the facade
            "deepoffload/__init__.py": "",
            "deepoffload/errors.py": "",
            "deepoffload/swap/t.py": "from ..formats.r import R\n",  # sibling part of the same layer
            "deepoffload/formats/r.py": "",
            "deepoffload/checkpoint/api.py": "from ..formats import r\n",  # down: fine
            "deepoffload/storage.py": "",  # no part of the table
        },
    )
    assert [(v.path, v.line, v.kind) for v in check(tmp_path)] == [
        ("deepoffload/io/a.py", 5, "upward"),
        ("deepoffload/io/a.py", 7, "upward"),
        ("deepoffload/io/b.py", 1, "upward"),
        ("deepoffload/storage.py", 1, "unlayered"),
        ("deepoffload/swap/t.py", 1, "sideways"),
    ]


def test_the_check_finds_private_names_used_across_modules(tmp_path):
    write(
        tmp_path,
        {
            "deepoffload/io/__init__.py": "_shared = 1\n",
            "deepoffload/io/a.py": "from . import _shared\n"  # from the package's __init__: another module
            "from .b import _hidden, __all__, _\n"  # only _hidden is private
            "from .. import _lazy\n"  # an underscore module, not a name
            "import deepoffload.io.b as bee\n"
            "import deepoffload.io.b\n"
            "from . import b\n"
            "def f():\n    return bee._x, b._y, b.__name__, deepoffload.io.b._z, deepoffload._lazy.go, _own\n"
            "_own = 1\n",
            "deepoffload/io/b.py": "_hidden = __all__ = _ = _x = _y = _z = 1\n",
            "deepoffload/_lazy.py": "go = 1\n",
        },
    )
    assert [(v.line, v.message) for v in check(tmp_path) if v.kind == "private"] == [
        (1, "imports _shared from deepoffload.io"),
        (2, "imports _hidden from deepoffload.io.b"),
        (8, "reads _x of deepoffload.io.b"),
        (8, "reads _y of deepoffload.io.b"),
        (8, "reads _z of deepoffload.io.b"),
    ]


def test_the_check_finds_swallowed_errors(tmp_path):
    write(
        tmp_path,
        {
            "deepoffload/errors.py": "def f(path):\n"
            "    try:\n        open(path)\n    except OSError:\n        pass\n"  # 4: swallowed
            "    for p in path:\n"
            "        try:\n            open(p)\n        except OSError:\n            continue\n"  # 9: swallowed
            "    try:\n        open(path)\n    except OSError:\n        return None\n"  # 13: swallowed
            "    try:\n        open(path)\n"
            "    # the file may be gone: nothing to close\n    except OSError:\n        pass\n"  # 18: says why
            "    try:\n        open(path)\n    except OSError:  # says why\n        pass\n"
            "    try:\n        open(path)\n    except OSError:\n        pass  # says why\n"
            "    try:\n        open(path)\n    except OSError:\n        raise\n"
            "    try:\n        open(path)\n    except OSError as e:\n        log(e)\n"  # handled
            "    try:\n        open(path)\n    except OSError:\n        s = '# not a comment'\n        return s\n",
        },
    )
    assert [v.line for v in check(tmp_path) if v.kind == "swallow"] == [4, 9, 13]


def test_the_script_runs_on_a_checkout_and_filters_by_folder(tmp_path):
    write(
        tmp_path,
        {
            "deepoffload/io/a.py": "from ..swap import t\n",
            "deepoffload/swap/t.py": "try:\n    import os\nexcept ImportError:\n    pass\n",
        },
    )

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(CHECKER), str(tmp_path), *args], capture_output=True, text=True)

    everything = run()
    assert everything.returncode == 1
    assert everything.stdout.splitlines() == [
        "deepoffload/io/a.py:1: upward: deepoffload.io.a (layer 3, deepoffload.io) imports deepoffload.swap.t"
        " (layer 5, deepoffload.swap)",
        "deepoffload/swap/t.py:3: swallow: except ImportError: pass (no comment why)",
    ]
    assert run("--under", "deepoffload/swap").stdout.splitlines() == everything.stdout.splitlines()[1:]
    (tmp_path / "deepoffload/swap/t.py").write_text("")
    assert run("--under", "deepoffload/swap").returncode == 0
