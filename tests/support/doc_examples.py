"""The public API's docstrings as a reader of the reference meets them: Google sections that match the signatures,
and Example sections that run.

Used by ``tests/test_docstrings.py``; run directly to check some names while writing them:
``python tests/support/doc_examples.py AsyncIOHandle save`` (no names: every public name).
"""

from __future__ import annotations

import dataclasses
import doctest
import inspect
import os
import re
import sys
import tempfile
from pathlib import Path

SECTION = re.compile(r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Example|Examples|Note|Notes|Warning):\s*$")
ITEM = re.compile(r"^    (\*{0,2}[A-Za-z_][A-Za-z0-9_]*)(?: \([^)]*\))?:")


def public_names() -> list[str]:
    """The names of ``deepoffload.__all__`` that are functions or classes other than exceptions."""
    import deepoffload

    names = []
    for name in deepoffload.__all__:
        obj = getattr(deepoffload, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            names.append(name)
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
    return annotation not in (inspect.Signature.empty, None, "None")


def problems(name: str) -> list[str]:
    """What the docstrings of ``deepoffload.<name>`` (and its public methods) lack."""
    import deepoffload

    obj = getattr(deepoffload, name)
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
    out = [f"{qualname}: argument {p!r} not in Args" for p in sorted(missing)]
    if returns_value(fn) and "Returns" not in found and "Yields" not in found and "\n" in doc.strip():
        out.append(f"{qualname}: no Returns section")
    return out


def run_examples(name: str) -> tuple[int, str]:
    """Runs every doctest in ``deepoffload.<name>``'s docstrings (its methods' too) in a fresh temporary folder.

    Returns:
        The number of failed examples and the runner's report.
    """
    import deepoffload

    obj = getattr(deepoffload, name)
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="doc-example-") as folder:
        os.chdir(folder)
        try:
            for test in finder.find(obj, name=f"deepoffload.{name}", module=False, globs={}):
                runner.run(test, out=report.append)
        finally:
            os.chdir(old)
    return runner.failures, "".join(report)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    names = argv or public_names()
    failed = 0
    for name in names:
        for line in problems(name):
            print(line)
            failed += 1
        failures, report = run_examples(name)
        if failures:
            print(report)
            failed += failures
        print(f"{name}: {'ok' if not failures else f'{failures} example(s) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
