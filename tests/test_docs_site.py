"""mkdocs_hooks.py, which generates the parts of the documentation site that follow the code: the reference covers
every public name, option, config key and environment variable, main names first; the site holds user documentation
only (no development notes, no build code among its pages). (The whole site is built by ci/test.sh's docs phase.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HOOKS = REPO / "mkdocs_hooks.py"
pytestmark = pytest.mark.skipif(not HOOKS.exists(), reason="needs the source tree")


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
    pages = [p.read_text() for p in (REPO / "docs" / "reference").glob("*.md")]
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


def test_the_engines_table_is_the_registry_s(hooks):
    from deepoffload.io.engines import engines

    rows = hooks.engines_markdown().splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{e.name}`" for e in engines()]
    assert all(e.description in row for e, row in zip(engines(), rows))
    assert sum("<!-- generated: engines -->" in p.read_text() for p in (REPO / "docs").rglob("*.md")) == 1


def test_the_extensions_table_is_the_registries(hooks):
    from deepoffload.swap.codecs import codec_names
    from deepoffload.swap.layouts import layout_names
    from deepoffload.swap.params.blocks.adapters import adapters

    rows = hooks.extensions_markdown().splitlines()[2:]
    names = [row.split(" | ")[1] for row in rows]
    assert names == [f"`{n}`" for n in (*layout_names(), *codec_names(), *(a.name for a in adapters()))]
    assert all(row.split(" | ")[3].strip(" |") for row in rows), "every built-in says what it is"
    assert sum("<!-- generated: extensions -->" in p.read_text() for p in (REPO / "docs").rglob("*.md")) == 1


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


def test_the_reference_leads_with_the_main_names_and_ends_with_the_errors(hooks):
    import deepoffload

    order = hooks.reference_order(deepoffload.__all__)
    assert sorted(order) == sorted(n for n in deepoffload.__all__ if not n.startswith("_"))
    assert order[:4] == ["from_pretrained", "offload_parameters", "ParameterOffload", "OffloadedOptimizer"]
    errors = [n for n in order if n.endswith("Error")]
    assert order[-len(errors) :] == errors and "DeepOffloadError" in errors
    text = hooks.api_markdown()
    assert text.index("::: deepoffload.from_pretrained") < text.index("deepoffload.DeepOffloadError")


def test_the_site_holds_user_documentation_only():
    """Development notes and the build's own code are not pages: nothing under docs/ but user pages and assets."""
    docs = REPO / "docs"
    assert not (docs / "notes").exists() and not list(docs.rglob("*.py")), "development files under docs/"
    assert (REPO / "dev-notes").is_dir()
    config = (REPO / "mkdocs.yml").read_text()
    assert "notes" not in config.split("\nnav:", 1)[1] and "hooks:\n  - mkdocs_hooks.py" in config
    # a user page does not send readers to the development notes (they are not on the site, and neither is the
    # contributors' page, dev-notes/development.md)
    assert not (docs / "development.md").exists() and "development.md" not in config
    for page in docs.rglob("*.md"):
        assert "dev-notes" not in page.read_text(), f"{page.relative_to(REPO)} points to the development notes"


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
        keys = {"label", "x", "y"} if data.get("kind") == "curve" else {"label", "value"}  # curve: lines of x, y
        assert data["results"] and all(keys <= set(r) for r in data["results"]), path
        assert plot.render_file(path).startswith(b"\x89PNG"), path


@pytest.mark.slow
def test_the_main_pages_do_not_scroll_sideways_in_chromium(tmp_path):
    """The site built as CI builds it, opened in headless Chromium at 1280 px: no code block, table or page of the
    main pages is wider than its box (ci/check_site_width.py; chromium is one of the tests' system packages)."""
    import os
    import shutil
    import subprocess
    import sys

    pytest.importorskip("mkdocs")
    if not any(map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))):
        pytest.skip("no chromium (apt-get install chromium; ci/setup-tests.sh installs it)")
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    check = subprocess.run(
        [sys.executable, str(REPO / "ci" / "check_site_width.py"), str(site)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": fits at 1280 px") >= 6, check.stdout
