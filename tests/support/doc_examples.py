"""The public API's docstrings as a reader of the reference meets them: Google sections that match the signatures,
and Example sections that run.

The public API is every name in the ``__all__`` of the modules in ``PUBLIC_MODULES`` (the ones the reference pages
show). Used by ``tests/test_docstrings.py``; run directly to check some names while writing them:
``python tests/support/doc_examples.py AsyncIOHandle formats.load_file`` (names relative to ``deepoffload``; no
names: every public name).
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

PUBLIC_MODULES = ("deepoffload", "deepoffload.formats", "deepoffload.dcp", "deepoffload.integrations.deepspeed")
ROOT = Path(__file__).resolve().parents[2]
FENCED = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

SECTION = re.compile(r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Example|Examples|Note|Notes|Warning):\s*$")
ITEM = re.compile(r"^    (\*{0,2}[A-Za-z_][A-Za-z0-9_]*)(?: \([^)]*\))?:")


def resolve(name: str):
    """The object of a public name: ``save`` or ``formats.load_file`` (relative to ``deepoffload``) or a full name."""
    full = name if name.startswith("deepoffload") else f"deepoffload.{name}"
    module, _, attribute = full.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def public_names() -> list[str]:
    """The full names of the public modules' ``__all__`` entries that are functions or classes other than
    exceptions.
    """
    names = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                names.append(f"{module_name}.{name}")
    return names


def sections(doc: str) -> dict[str, list[str]]:
    """The Google sections of a docstring, each with its lines (dedented once)."""
    found: dict[str, list[str]] = {}
    current = None
    for line in inspect.cleandoc(doc).splitlines():
        match = SECTION.match(line)
        if match:
            current = match.group(1)
            found[current] = []
        elif current and (line.startswith("    ") or not line.strip()):
            found[current].append(line)
        else:
            current = None
    return found


def documented(lines: list[str]) -> set[str]:
    return {m.group(1).lstrip("*") for m in map(ITEM.match, lines) if m}


def parameters(fn) -> list[str]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values() if p.name not in ("self", "cls")]


def returns_value(fn) -> bool:
    annotation = inspect.signature(fn).return_annotation
    return annotation not in (inspect.Signature.empty, None, "None", "NoReturn", "Never", typing.NoReturn, typing.Never)


def problems(name: str) -> list[str]:
    """What the docstrings of the public ``name`` (and its public methods) lack."""
    obj = resolve(name)
    out = []
    doc = inspect.getdoc(obj) or ""
    found = sections(doc)
    if "Example" not in found and "Examples" not in found:
        out.append(f"{name}: no Example section")
    if inspect.isclass(obj):
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        described = documented(found.get("Args", []) + found.get("Attributes", []))
        init = obj.__dict__.get("__init__")
        wanted = fields | (set(parameters(init)) if init is not None and not fields else set())
        out += [f"{name}: constructor argument {p!r} not in Args/Attributes" for p in sorted(wanted - described)]
        for attr, member in vars(obj).items():
            if attr.startswith("_") or not inspect.isfunction(member):
                continue
            out += _function_problems(f"{name}.{attr}", member)
    else:
        out += _function_problems(name, obj)
    return out


def _function_problems(qualname: str, fn) -> list[str]:
    doc = inspect.getdoc(fn)
    if not doc:
        return [f"{qualname}: no docstring"]
    found = sections(doc)
    missing = set(parameters(fn)) - documented(found.get("Args", []))
    if "\n" not in doc.strip():  # a one-line docstring may name its few arguments in its sentence
        missing = {p for p in missing if f"``{p}``" not in doc}
    out = [f"{qualname}: argument {p!r} not in Args" for p in sorted(missing)]
    if returns_value(fn) and "Returns" not in found and "Yields" not in found and "\n" in doc.strip():
        out.append(f"{qualname}: no Returns section")
    return out


def run_examples(name: str) -> tuple[int, str]:
    """Runs every doctest in the public ``name``'s docstrings (its methods' too) in a fresh temporary folder.

    Returns:
        The number of failed examples and the runner's report.
    """
    obj = resolve(name)
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="doc-example-") as folder:
        os.chdir(folder)
        try:
            for test in finder.find(obj, name=name, module=False, globs={}):
                runner.run(test, out=report.append)
        finally:
            os.chdir(old)
    return runner.failures, "".join(report)


def fenced_examples(name: str) -> list[str]:
    """The ```` ```python ```` blocks of the Example sections of the public ``name`` (examples that need a separate
    process, such as ones that patch a third-party package).
    """
    doc = inspect.getdoc(resolve(name)) or ""
    found = sections(doc)
    text = "\n".join(line[4:] for line in found.get("Example", []) + found.get("Examples", []))
    return FENCED.findall(text + "\n")


def run_fenced(code: str) -> subprocess.CompletedProcess:
    """Run one fenced example in a child process, in a fresh temporary folder, with this checkout importable."""
    with tempfile.TemporaryDirectory(prefix="doc-example-") as folder:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        return subprocess.run(
            [sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True, timeout=300
        )


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    names = argv or public_names()
    failed = 0
    for name in names:
        for line in problems(name):
            print(line)
            failed += 1
        for code in fenced_examples(name):
            child = run_fenced(code)
            if child.returncode != 0:
                print(f"{name}: a fenced example failed:\n{code}\n{child.stdout}{child.stderr}")
                failed += 1
        failures, report = run_examples(name)
        if failures:
            print(report)
            failed += failures
        print(f"{name}: {'ok' if not failures else f'{failures} example(s) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
