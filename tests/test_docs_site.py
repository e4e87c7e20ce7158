"""docs/hooks.py, which generates the parts of the documentation site that follow the code: the reference covers
every public name, option, config key and environment variable; every note in docs/notes/ gets a nav entry; a link
in a note to a repository file that is not a page does not break the strict build. (The whole site is built by
ci/test.sh's docs phase.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HOOKS = REPO / "docs" / "hooks.py"
pytestmark = pytest.mark.skipif(not HOOKS.exists(), reason="needs the source tree's docs/")


@pytest.fixture(scope="module")
def hooks():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("deepoffload_docs_hooks", HOOKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_has_every_public_name(hooks):
    import deepoffload

    text = hooks.api_markdown()
    for name in deepoffload.__all__:
        if not name.startswith("_"):
            assert f"::: deepoffload.{name}\n" in text or f"heading: deepoffload.{name}\n" in text, name


PUBLIC_MODULES = ["deepoffload.formats", "deepoffload.dcp", "deepoffload.integrations.deepspeed"]


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_each_public_module_has_a_reference_page_with_every_name(hooks, module_name):
    import importlib

    text = hooks.api_markdown(module_name)
    names = importlib.import_module(module_name).__all__
    assert [line for line in text.splitlines() if line] == [f"::: {module_name}.{name}" for name in names]
    pages = [p.read_text() for p in (Path(hooks.__file__).parent / "reference").glob("*.md")]
    assert sum(f"<!-- generated: api {module_name} -->" in page for page in pages) == 1


def test_the_config_page_has_every_key_and_variable(hooks):
    from deepoffload.op_builder import env

    from deepoffload import AioConfig, SwapConfig

    text = hooks.config_markdown()
    for key in (*AioConfig.keys(), *SwapConfig.swap_keys()):
        assert f"| `{key}`" in text, key
    for name in env.VARIABLES:
        assert f"`{name}`" in text, name
    assert "`DEEPOFFLOAD_AIO_BLOCK_SIZE`" in text


def test_the_cli_page_has_every_command(hooks):
    from deepoffload.cli.main import COMMANDS

    text = hooks.cli_markdown()
    for command in COMMANDS:
        assert f"## `deepoffload {command}`" in text and f"usage: deepoffload {command}" in text


def test_the_residency_diagram_has_every_transition(hooks):
    from deepoffload.swap.params import Residency

    text = hooks.residency_markdown()
    assert "stateDiagram-v2" in text
    assert f"{Residency.RESIDENT.name} --> {Residency.WRITING.name}" in text
    assert f"{Residency.RESTORED.name} --> {Residency.READING.name}" not in text


def test_every_note_gets_a_nav_entry_and_none_an_empty_section(hooks, tmp_path):
    (tmp_path / "notes").mkdir()
    for name in ("b29.md", "a25.md"):
        (tmp_path / "notes" / name).write_text("# a note\n")
    nav = [{"Home": "index.md"}, {hooks.NOTES: []}]
    config = hooks.on_config({"docs_dir": str(tmp_path), "nav": nav})
    assert config["nav"][1] == {hooks.NOTES: ["notes/a25.md", "notes/b29.md"]}
    for note in (tmp_path / "notes").iterdir():
        note.unlink()
    config = hooks.on_config({"docs_dir": str(tmp_path), "nav": [{"Home": "index.md"}, {hooks.NOTES: []}]})
    assert config["nav"] == [{"Home": "index.md"}]


def test_a_notes_link_outside_the_site_becomes_its_path(hooks, tmp_path):
    (tmp_path / "guides").mkdir()
    (tmp_path / "guides" / "io-handle.md").write_text("# x\n")
    text = (
        "see [the test](../../tests/test_x.py), [the guide](../guides/io-handle.md#a), "
        "[a site](https://example.org/x.py) and ![plot](../assets/p.png)"
    )
    out = hooks._unlink_outside_docs(text, "notes/a.md", tmp_path)
    assert "the test (`../../tests/test_x.py`)" in out
    assert "[the guide](../guides/io-handle.md#a)" in out and "[a site](https://example.org/x.py)" in out
    assert "![plot](../assets/p.png)" in out


@pytest.mark.slow
def test_every_benchmark_result_says_its_command_machine_and_date_and_plots(tmp_path, monkeypatch):
    """The files the benchmarks page plots carry what the page promises, in the format --json writes."""
    import json
    import sys

    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("common", None)
    from common import write_json

    monkeypatch.setattr(sys, "argv", ["x", "--rounds", "1"])
    write_json(
        str(tmp_path / "fresh.json"), "engines_vs_fio", "a title", [{"label": "a / b", "value": 1.2, "bound": 0.95}]
    )
    spec = importlib.util.spec_from_file_location("deepoffload_plot", REPO / "benchmarks" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    files = [tmp_path / "fresh.json", *sorted((REPO / "benchmarks" / "results").glob("*.json"))]
    assert len(files) >= 4
    for path in files:
        data = json.loads(path.read_text())
        assert data["command"].startswith("python benchmarks/"), path
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]) and data["machine"] and data["title"], path
        assert data["results"] and all({"label", "value"} <= set(r) for r in data["results"]), path
        assert plot.render_file(path).startswith(b"\x89PNG"), path
