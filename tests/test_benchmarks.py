"""Every script in benchmarks/ runs to the end at a tiny size (a smoke test: the scripts' figures are not checked,
only that each still runs against the library as it is now), and none is left out of the list below."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
pytestmark = pytest.mark.skipif(not BENCHMARKS.is_dir(), reason="needs the source tree")

# script -> its arguments at a tiny size ("{folder}": a scratch folder on a real disk; "{python}": this interpreter)
TINY = {
    "activations.py": ["--folder", "{folder}", "--quick"],
    "bounce_buffer.py": ["--path", "{folder}", "--size", "1M", "--rounds", "1"],
    "build_and_load.py": ["--rounds", "1"],
    "checkpoint.py": ["--path", "{folder}", "--size", "4M", "--rounds", "1"],
    "checkpoint_load.py": ["--path", "{folder}", "--size", "4M", "--shard-size", "2M", "--rounds", "1"],
    "checkpoint_phases.py": ["--path", "{folder}", "--size", "4M", "--rounds", "1"],
    "codec.py": ["--folder", "{folder}", "--quick"],
    "deepspeed_zero3_ab.py": ["--path", "{folder}", "--rounds", "1", "--steps", "1", "--width", "64", "--layers", "1"],
    "drives.py": ["--quick"],
    "device_staging.py": ["--path", "{folder}", "--size", "4M", "--chunk", "1M", "--rounds", "1"],
    "engines_vs_fio.py": ["--path", "{folder}", "--size", "4M", "--rounds", "1"],
    "figures.py": ["--list"],
    "kv_cache.py": ["--folder", "{folder}", "--quick"],
    "hf_llama_stream.py": ["--folder", "{folder}", "--tiny", "--rounds", "1"],
    "lora.py": ["--folder", "{folder}", "--quick"],
    "moe.py": ["--folder", "{folder}", "--quick", "--rounds", "1"],
    "optimizer_many_tensors.py": ["--folder", "{folder}", "--params", "100", "--rounds", "1"],
    "optimizer_offload.py": [
        "--folder",
        "{folder}",
        "--state-gb",
        "0.002",
        "--rounds",
        "1",
        "--checksum",
        "--rss-sizes",
        "0.002",
        "--rss-numel",
        "1024",
    ],
    "optimizer_overlap.py": [
        "--folder",
        "{folder}",
        "--rounds",
        "1",
        "--llama-hidden",
        "32",
        "--llama-layers",
        "1",
        "--llama-vocab",
        "128",
        "--mlp-width",
        "32",
        "--mlp-layers",
        "2",
    ],
    "optimizer_timeline.py": ["--folder", "{folder}", "--mlp-width", "64", "--mlp-layers", "2", "--steps", "1"],
    "param_offload.py": ["--folder", "{folder}", "--tiny", "--steps", "1", "--checksum"],
    "save_parts.py": ["--path", "{folder}", "--size", "4M", "--rounds", "1", "--tensors", "2", "--tensor-size", "1M"],
    "small_ops.py": ["--path", "{folder}", "--cases", "4x64K", "--rounds", "1"],
    "vs_deepspeed.py": ["--reference-python", "{python}", "--path", "{folder}", "--size", "4M", "--rounds", "1"],
}
HELPERS = {"common.py", "plot.py"}  # imported by the scripts; plot.py draws results (tests/test_docs_site.py runs it)
# measured against DeepSpeed's own ops, which take minutes to build (as in tests/integrations, opt-in)
NEEDS_DEEPSPEED_OPS = {"deepspeed_zero3_ab.py", "vs_deepspeed.py"}
NEEDS_ROOT = {"drives.py"}  # throttled loop-device drives (tests/support/drives.py)


def has_accelerator() -> bool:
    import torch

    return torch.accelerator.current_accelerator(check_available=True) is not None


def test_every_script_is_listed():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - HELPERS
    assert scripts == set(TINY), "list each script of benchmarks/ in TINY with arguments that make it quick"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(TINY))
def test_script_runs_at_a_tiny_size(script, scratch, aio):
    if script in NEEDS_DEEPSPEED_OPS and os.environ.get("DEEPOFFLOAD_TEST_DEEPSPEED_OP") != "1":
        pytest.skip("set DEEPOFFLOAD_TEST_DEEPSPEED_OP=1 to run the scripts that build DeepSpeed's own ops (minutes)")
    if script in NEEDS_ROOT:
        from tests.support.drives import unavailable

        reason = unavailable("loop", throttle=True)
        if reason is not None:
            pytest.skip(f"{script} needs throttled loop drives: {reason}")
    args = [a.format(folder=scratch, python=sys.executable) for a in TINY[script]]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "TMPDIR": str(scratch),
    }
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=scratch,
    )
    if script == "device_staging.py" and not has_accelerator():
        # without an accelerator the script must say so in one line, not fail half-way
        assert proc.returncode == 1 and "no accelerator" in proc.stderr, proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip(), proc.stderr


def test_every_plot_on_the_benchmarks_page_has_its_figure_command():
    """One command refreshes every figure of the page: each plot it embeds is in benchmarks/figures.py, each figure
    there is embedded, and each command names a benchmark that exists and writes the results file it draws from."""
    import re

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import figures
    finally:
        sys.path.remove(str(BENCHMARKS))
    page = (REPO / "docs" / "benchmarks.md").read_text()
    embedded = set(re.findall(r"\(assets/plots/([\w]+)\.png\)", page))
    drawn = set(figures.FIGURES) | {also for _, _, others in figures.FIGURES.values() for also in others}
    assert embedded == drawn, "embed each figure of benchmarks/figures.py, and list each plot there"
    for name in figures.FIGURES:
        argv = figures.command(name, "DIR")
        assert (REPO / argv[1]).is_file(), argv
        assert argv[argv.index("--json") + 1] == f"benchmarks/results/{name}.json", argv
