"""The README, ``ARCHITECTURE.md`` (which the site includes) and the documentation are true to the code: every
``python`` block runs as printed (or is marked ``<!-- no-run: reason -->`` just above it, or only includes an
example, which tests/test_examples.py runs), every repository file and folder they name exists, and the build-time
figure they quote is the builder's.

Blocks run in one child process (one import of torch and transformers for all), each block in a fresh namespace, in
a scratch folder where ``/nvme`` is a scratch sub-folder and ``llama/`` a tiny Llama written by ``save_pretrained``
(for the blocks that read a model folder). Development notes (dev-notes/) are not documentation and are not
run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").rglob("*.md"))]
pytestmark = pytest.mark.skipif(not README.exists() or not (REPO / "docs").exists(), reason="needs the source tree")

BLOCK = re.compile(r"(?:<!-- no-run: (?P<reason>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, no-run reason or None) of each python block of ``page``."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start("code")) + 1, m.group("code"), m.group("reason")) for m in BLOCK.finditer(text)
    ]


def runnable(page: Path) -> list[tuple[int, str]]:
    return [
        (line, code) for line, code, reason in blocks(page) if reason is None and not code.lstrip().startswith("--8<--")
    ]


RUNNER = r"""
import json, os, sys, traceback
blocks = json.loads(sys.stdin.read())
base = os.getcwd()
if any('"llama/"' in code for _, _, code in blocks):
    import torch, transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained("llama")
failed = []
for page, line, code in blocks:
    os.makedirs("nvme", exist_ok=True)
    try:
        exec(compile(code.replace("/nvme", os.path.join(base, "nvme")), f"{page}:{line}", "exec"), {})
    except BaseException:
        failed.append(f"{page}, block at line {line}:\n" + traceback.format_exc())
print("\n".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_every_python_block_runs_or_says_why_not():
    assert sum(len(runnable(p)) for p in PAGES) >= 10
    for page in PAGES:
        for line, code, reason in blocks(page):
            if reason is not None:
                assert len(reason.strip()) > 10, f"{page.name}:{line}: a no-run block needs a reason"
            if code.lstrip().startswith("--8<--"):
                assert re.fullmatch(r'\s*--8<-- "examples/\w+\.py(:\w+)?"\s*', code), f"{page.name}:{line}"


@pytest.mark.slow
def test_python_blocks_run_as_printed(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    todo = [(str(page.relative_to(REPO)), line, code) for page in PAGES for line, code in runnable(page)]
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER],
        cwd=tmp_path,
        input=json.dumps(todo),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-8000:]


GENERATED = {"deepoffload/_ops/build_info.json"}  # written by a prebuild, not in the repository


def test_named_files_exist():
    for page in PAGES:
        for name in set(re.findall(r"`([\w./-]+\.(?:md|sh|py|toml|json|cpp))`", page.read_text())):
            if "/" in name and not name.startswith(("/", "out/", "llama/")) and name not in GENERATED:
                candidates = [REPO / name, REPO / "tests" / name, REPO / "csrc" / "aio" / name]
                assert any(c.exists() for c in candidates), f"{page.relative_to(REPO)} names {name}, which is not here"
        for name in set(
            re.findall(r"`((?:deepoffload|op_builder|csrc|tests|benchmarks|examples)/[\w./-]*/)`", page.read_text())
        ):
            assert (REPO / name).is_dir(), f"{page.relative_to(REPO)} names the folder {name}, which is not here"


def test_build_message_names_no_figure_but_the_machines_own(tmp_path, monkeypatch):
    """Before any build here the message names no time (another machine's would mislead); after one, that one's."""
    from deepoffload.op_builder import builder

    monkeypatch.setattr(builder, "_build_times_path", lambda: tmp_path / "build_times.json")
    assert builder._last_build_seconds() is None
    builder._record_build_seconds(8.9)
    assert builder._last_build_seconds() == 9
    text = (REPO / "docs" / "concepts" / "building.md").read_text()
    assert "the last build here took" in text and "usually about" not in text


def test_hugging_face_folders_are_loaded_through_from_pretrained():
    """deepoffload.from_pretrained is the front door for a save_pretrained folder: the README's quick start, the
    guide and the example that loads a folder show it, not the longer init_empty_weights + checkpoint= route."""
    for path in (README, REPO / "docs" / "guides" / "hugging-face.md", REPO / "examples" / "hf_stream_generate.py"):
        text = path.read_text()
        assert "deepoffload.from_pretrained(" in text and "init_empty_weights" not in text, path.relative_to(REPO)
