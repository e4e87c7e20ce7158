"""The README's snippets run as printed, the files it names exist, and its build-time figure is the one the
builder prints by default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
pytestmark = pytest.mark.skipif(not README.exists(), reason="needs the source tree")


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_deepspeed_snippet_runs_as_printed(aio, scratch):
    block = next(b for b in python_blocks() if "AsyncIOBuilder" in b)
    namespace: dict = {}
    exec(compile(block.replace("/nvme/", f"{scratch}/"), "README.md", "exec"), namespace)  # noqa: S102
    assert (scratch / "x").stat().st_size == 2 << 20  # 1 << 20 fp16 elements


def test_named_files_exist():
    for name in set(re.findall(r"`([\w./-]+\.(?:md|sh|py|toml))`", README.read_text())):
        if "/" in name or name in ("DESIGN.md", "setup.py", "pyproject.toml"):
            assert (REPO / name).exists(), f"the README names {name}, which is not in the repository"


def test_build_time_figure_matches_the_builder():
    from deepoffload.op_builder.builder import DEFAULT_BUILD_SECONDS

    figures = set(re.findall(r"builds in about (\d+) s", README.read_text()))
    assert figures == {str(DEFAULT_BUILD_SECONDS)}
