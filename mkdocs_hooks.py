"""mkdocs hooks: the parts of the site generated from the code, so they cannot drift from it.

- ``<!-- generated: api -->`` in a page becomes one mkdocstrings block per name in ``deepoffload.__all__`` (public
  names only, never module paths that may move); ``<!-- generated: api deepoffload.formats -->`` the same for the
  ``__all__`` of another public module;
- ``<!-- generated: cli -->`` becomes the help of ``deepoffload`` and of each of its commands, from the parser;
- ``<!-- generated: residency -->`` becomes the state diagram of a streamed block, from its transition table;
- ``<!-- generated: config -->`` becomes the tables of configuration keys (``AioConfig``, ``SwapConfig``) and
  environment variables (``op_builder.env.VARIABLES``);
- ``<!-- generated: engines -->`` becomes the table of IO engines, from their registry (``deepoffload.io.engines``);
- ``<!-- generated: extensions -->`` becomes the table of storage layouts, byte codecs and block adapters, from their
  registries;
- every ``benchmarks/results/*.json`` becomes a plot ``assets/plots/<name>.png`` (``benchmarks/plot.py``).

It lives beside mkdocs.yml, outside ``docs/``, so that the site holds user documentation only (development notes
are in ``dev-notes/``, not built).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def on_files(files, config):
    plot = _load_module("deepoffload_docs_plot", ROOT / "benchmarks" / "plot.py")
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        files.append(File.generated(config, f"assets/plots/{path.stem}.png", content=plot.render_file(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    markdown = re.sub(r"<!-- generated: api ([\w.]+) -->", lambda m: api_markdown(m.group(1)), markdown)
    generators = {
        "api": api_markdown,
        "cli": cli_markdown,
        "config": config_markdown,
        "engines": engines_markdown,
        "extensions": extensions_markdown,
        "residency": residency_markdown,
    }
    for name, make in generators.items():
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The names people start from, first in the reference, in this order; then the rest of deepoffload.__all__ in its
# order, and the exception classes last.
MAIN = (
    "from_pretrained",
    "offload_parameters",
    "ParameterOffload",
    "OffloadedOptimizer",
    "SwapConfig",
    "TrainOptions",
    "LoadOptions",
    "StreamOptions",
    "save",
    "save_async",
    "load",
    "AsyncIOHandle",
    "AioConfig",
)


def reference_order(names) -> list[str]:
    public = [n for n in names if not n.startswith("_")]
    main = [n for n in MAIN if n in public]
    errors = [n for n in public if n.endswith("Error") and n not in main]
    return main + [n for n in public if n not in main and n not in errors] + errors


def api_markdown(module_name: str = "deepoffload") -> str:
    import importlib

    if module_name != "deepoffload":
        module = importlib.import_module(module_name)
        return "\n".join(f"::: {module_name}.{name}\n" for name in module.__all__ if not name.startswith("_"))
    import deepoffload

    blocks = []
    for name in reference_order(deepoffload.__all__):
        obj = getattr(deepoffload, name)
        module = obj.__module__.removeprefix("deepoffload.")
        if module.split(".")[0] == "op_builder":
            # deepoffload.op_builder is the top-level op_builder/ folder of the source tree, mapped under the
            # package when installed: the static analysis finds it under its folder's name, in its own module
            blocks.append(f"::: {module}.{obj.__qualname__}\n    options:\n      heading: deepoffload.{name}\n")
        else:
            blocks.append(f"::: deepoffload.{name}\n")
    return "\n".join(blocks)


def cli_markdown() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal's width; fixed here so the page is stable
    try:
        from deepoffload.cli.main import build_parser

        parser = build_parser()
        parts = ["## `deepoffload`\n", "```text\n" + parser.format_help() + "```\n"]
        subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        for name, sub in subparsers.choices.items():
            parts += [f"## `deepoffload {name}`\n", "```text\n" + sub.format_help() + "```\n"]
        return "\n".join(parts)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _field_meanings(cls) -> dict[str, str]:
    """``name: meaning`` lines of a dataclass's docstring (continuation lines joined)."""
    meanings: dict[str, str] = {}
    current = None
    for line in (cls.__doc__ or "").splitlines():
        match = re.match(r"^\s*([a-z_]+): (.*)$", line)
        if match and match.group(1) in {f.name for f in dataclasses.fields(cls)}:
            current = match.group(1)
            meanings[current] = match.group(2).strip()
        elif current and line.startswith("        ") and line.strip():
            meanings[current] += " " + line.strip()
        else:
            current = None
    return meanings


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def engines_markdown() -> str:
    from deepoffload.io.engines import engines

    rows = [(f"`{e.name}`", "native op" if e.native else "Python", e.description) for e in engines()]
    return _table(("engine", "runs in", "what it is"), rows)


def extensions_markdown() -> str:
    from deepoffload.swap.codecs import codec_class, codec_names
    from deepoffload.swap.layouts import layout_class, layout_names
    from deepoffload.swap.params.blocks.adapters import adapters

    rows = [("storage layout", f"`{n}`", "`SwapConfig(layout=)`", layout_class(n).description) for n in layout_names()]
    rows += [("byte codec", f"`{n}`", "`SwapConfig(codec=)`", codec_class(n).description) for n in codec_names()]
    rows += [("block adapter", f"`{a.name}`", "`register_adapter`", getattr(a, "description", "")) for a in adapters()]
    return _table(("kind", "name", "chosen by", "what it is"), rows)


def config_markdown() -> str:
    from deepoffload.op_builder import env

    from deepoffload.config import ALIASES, AioConfig
    from deepoffload.swap.config import SWAP_ALIASES, SwapConfig

    def rows(cls, aliases, skip=()):
        meanings = _field_meanings(cls)
        out = []
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            default = f.default if f.default is not dataclasses.MISSING else "(see below)"
            alias = [a for a, target in aliases.items() if target == f.name]
            name = f"`{f.name}`" + (f" (alias `{alias[0]}`)" if alias else "")
            out.append((name, f"`{default!r}`", meanings.get(f.name, "")))
        return out

    aio_rows = rows(AioConfig, ALIASES)
    env_rows = [
        (f"`{v.name}`", v.kind, f"`{v.default!r}`" if v.default not in (None, "") else "unset", v.meaning)
        for v in env.VARIABLES.values()
    ]
    env_rows += [
        (
            f"`{env.AIO_PREFIX}{key.upper()}`",
            "config value",
            f"`{getattr(AioConfig(), key)!r}`",
            f"overrides the `{key}` key",
        )
        for key in AioConfig.keys()
    ]
    return "\n".join(
        [
            "## Async-IO keys (`deepoffload.AioConfig`)\n",
            _table(("key", "default", "meaning"), aio_rows),
            "## Swapping keys (`deepoffload.SwapConfig`)\n",
            "These take the async-IO keys above too, at top level or in an `aio` section.\n",
            _table(("key", "default", "meaning"), rows(SwapConfig, SWAP_ALIASES, skip=("aio",))),
            "## Environment variables\n",
            "Every variable deepoffload reads (the table in `op_builder/env.py`, read through one parser).\n",
            _table(("variable", "kind", "default", "meaning"), env_rows),
        ]
    )


def residency_markdown() -> str:
    """The residency state machine of a streamed block, drawn from its transition table (the table the code checks
    every move against)."""
    from deepoffload.swap.params import Residency

    transitions = sys.modules[Residency.__module__].TRANSITIONS
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {Residency.ON_STORAGE.name}"]
    for source, targets in transitions.items():
        for target in sorted(targets, key=lambda r: list(Residency).index(r)):
            lines.append(f"    {source.name} --> {target.name}")
    lines.append(f"    {Residency.RESTORED.name} --> [*]")
    lines.append("```")
    rows = [
        (
            f"`{r.name}`",
            r.value,
            ", ".join(f"`{t.name}`" for t in sorted(transitions[r], key=list(Residency).index)) or "(final)",
        )
        for r in Residency
    ]
    return "\n".join(lines) + "\n\n" + _table(("state", "meaning", "may move to"), rows)
