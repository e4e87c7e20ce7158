"""``deepoffload plan``: the memory plan of a checkpoint's model under a limit, or the least limit that works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepoffload.cli.main import main
from deepoffload.cli.plan import blocks_of


def checkpoint(folder):
    from safetensors.torch import save_file

    state = {f"model.layers.{i}.{n}": torch.zeros(256, 256) for i in range(4) for n in ("q.weight", "k.weight")}
    state["model.embed.weight"] = torch.zeros(64, 256)
    save_file(state, str(folder / "model.safetensors"))
    return folder / "model.safetensors"


def test_blocks_are_numbered_prefixes():
    blocks, rest = blocks_of({"model.layers.0.a": 4, "model.layers.0.b": 4, "model.layers.1.a": 4, "head.w": 2})
    assert blocks == {"model.layers.0": 8, "model.layers.1": 4} and rest == 2


def test_plan_prints_the_parts_and_the_expected_peak(scratch, capsys):
    path = checkpoint(scratch)
    assert main(["plan", str(path), "--max-memory", "64GB", "--prefetch", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 blocks" in out and "prefetch 2" in out and "= expected peak" in out
    assert main(["plan", str(path), "--max-memory", "1MB", "--train"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "the smallest that works is" in out


def test_plan_refuses_bad_input(scratch, capsys):
    assert main(["plan", str(scratch / "missing.safetensors"), "--max-memory", "1GB"]) == 1
    assert "no such checkpoint" in capsys.readouterr().err
    assert main(["plan", str(checkpoint(scratch)), "--max-memory", "lots"]) == 2
    assert "--max-memory" in capsys.readouterr().err


# -- on the README's own quick-start outputs --------------------------------------------------------------------
README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^  (.*?)\s+(\d+\.\d) (MB|kB)$")


def readme_block(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading) :]
    return section[section.index("```python\n") + 10 : section.index("```\n", section.index("```python\n") + 10)]


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """A folder holding what the README's quick starts use and write: ckpt.pt (the optimizer quick start, run as
    printed) and llama/ (the tiny Llama that tests/test_docs.py gives the Hugging Face quick start)."""
    import transformers

    folder = tmp_path_factory.mktemp("quick-start")
    (folder / "nvme").mkdir()
    code = readme_block("## Quick start: optimizer state on NVMe").replace("/nvme", str(folder / "nvme"))
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(code, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "llama")
    return folder


def figures(out: str) -> dict[str, float]:
    """{row label: bytes} of plan's table (each figure as printed, so within half its last digit)."""
    rows = {}
    for line in out.splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = float(match.group(2)) * (1e6 if match.group(3) == "MB" else 1e3)
    return rows


def plan(*argv: str) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "deepoffload", "plan", *argv], capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow  # plan in fresh processes (torch imported in each)
@pytest.mark.parametrize("train", [False, True])
def test_plan_reads_the_readme_checkpoint_and_its_figures_add_up(quick_start, train):
    """ckpt.pt is {"model": state dict, "optimizer": ...} as the README saves it: plan finds the model's state dict,
    and its figures add up (running = its rows; expected peak = process + max(running, loading) + forward)."""
    code, out, err = plan(str(quick_start / "ckpt.pt"), "--max-memory", "2GB", *(["--train"] if train else []))
    assert code == 0, err
    assert "(the state dict under key 'model'): 2 blocks" in out, out  # Linear 0 and Linear 2 of the Sequential
    rows = figures(out)
    running = [v for k, v in rows.items() if k.startswith(("outside", "blocks kept", "in flight", "working", "optim"))]
    assert len(running) == (5 if train else 4), out
    assert abs(sum(running) - rows["= running"]) <= 0.05e6 * len(running), out
    assert rows["the larger of running and loading"] == max(rows["= running"], next(
        v for k, v in rows.items() if k.startswith("while loading")))  # fmt: skip
    parts = rows["the process now (torch imported)"] + rows["the larger of running and loading"]
    assert abs(parts + rows["left for the forward activations"] - rows["= expected peak"]) <= 0.15e6, out
    assert "prefetch 1" in out and "in flight: 1 read ahead" in out  # the default prefetch
    model = torch.load(quick_start / "ckpt.pt", weights_only=True)["model"]
    assert rows["blocks kept resident (max_resident_bytes)"] <= sum(t.nbytes for t in model.values()) * 1.01


@pytest.mark.slow  # plan in fresh processes (torch imported in each)
def test_plan_keeps_no_more_of_a_small_model_than_it_has(quick_start):
    code, out, err = plan(str(quick_start / "llama"), "--max-memory", "1GB")
    assert code == 0, err
    blocks = float(re.search(r"2 blocks, (\d+\.\d) kB in blocks", out).group(1)) * 1e3
    assert figures(out)["blocks kept resident (max_resident_bytes)"] == blocks, out


@pytest.mark.slow  # plan in fresh processes (torch imported in each)
def test_plan_refuses_with_a_short_table_and_the_smallest_limit_that_works(quick_start):
    code, out, _ = plan(str(quick_start / "llama"), "--max-memory", "10MB")
    assert code == 1
    table = out.splitlines()[1:]
    assert len(table) <= 6 and max(map(len, table)) <= 100, out
    rows = figures(out)
    parts = sum(v for k, v in rows.items() if not k.startswith(("=", "with")))
    assert abs(parts - rows["= the smallest --max-memory"]) <= 0.15e6, out
    assert "with --prefetch 1" in out  # the default prefetch's own figure
    smallest = rows["= the smallest --max-memory"]
    code, out, err = plan(str(quick_start / "llama"), "--max-memory", str(int(smallest + 2e6)))
    assert code == 0, out + err  # it works (2 MB more: the process measured again is not exactly as large)


@pytest.mark.slow  # plan in fresh processes (torch imported in each)
def test_plan_names_the_key_where_several_state_dicts_could_be(scratch):
    state = {"layers.0.w": torch.zeros(64, 64), "layers.1.w": torch.zeros(64, 64)}
    torch.save({"model": state, "ema": state, "step": 3}, scratch / "two.pt")
    code, _, err = plan(str(scratch / "two.pt"), "--max-memory", "2GB")
    assert code == 1 and "several state dicts, under ['model', 'ema']: pass --key" in err, err
    code, out, err = plan(str(scratch / "two.pt"), "--max-memory", "2GB", "--key", "ema")
    assert code == 0 and "under key 'ema'): 2 blocks" in out, out + err
    code, _, err = plan(str(scratch / "two.pt"), "--max-memory", "2GB", "--key", "step")
    assert code == 1 and "--key 'step' is not a state dict" in err, err


def test_streaming_from_a_saved_dict_names_the_key_and_the_model_alone_works(scratch):
    """offload_parameters(checkpoint=) on the README's ckpt.pt shape ({"model": ..., "optimizer": ...}) refuses,
    naming the key holding the state dict and what to do; the model's state dict saved alone then streams."""
    import deepoffload
    from deepoffload.errors import CheckpointError

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    torch.save({"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}}, scratch / "ckpt.pt")
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with pytest.raises(CheckpointError, match=r"state dicts under \['model'\].*plan --key model"):
        deepoffload.offload_parameters(
            meta, str(scratch / "swap"), load=deepoffload.LoadOptions(checkpoint=scratch / "ckpt.pt")
        )
    torch.save(torch.load(scratch / "ckpt.pt", weights_only=True)["model"], scratch / "model.pt")
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(2, 8)
    with deepoffload.offload_parameters(
        meta, str(scratch / "swap2"), load=deepoffload.LoadOptions(checkpoint=scratch / "model.pt")
    ):
        with torch.no_grad():
            assert torch.equal(meta(x), model(x))


@pytest.mark.slow  # plan and from_pretrained in fresh processes
def test_the_smallest_limit_plan_names_for_a_folder_works_with_from_pretrained(quick_start):
    """The README's route for a Hugging Face folder is ``from_pretrained(folder, stream=StreamOptions(max_memory=
    ...))``: the limit plan names as the smallest that works must work there, where transformers and the model (on
    meta) are in the process already when the limit is fitted."""
    code, out, _ = plan(str(quick_start / "llama"), "--max-memory", "10MB")
    assert code == 1, out
    smallest = int(figures(out)["= the smallest --max-memory"] + 2e6)  # 2 MB: the process measured again
    code = (
        "import sys, deepoffload\n"
        f"model, off = deepoffload.from_pretrained({str(quick_start / 'llama')!r}, path={str(quick_start)!r},"
        f" stream=deepoffload.StreamOptions(max_memory={smallest}))\n"
        "off.close(restore=False)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, out + proc.stderr[-1500:]


def test_a_dcp_folder_is_named_with_the_conversion_that_works(scratch, capsys):
    """A DCP folder (deepoffload.dcp writes them) is named as one, with the conversion to pass instead; the converted
    file goes through plan and streams with the model's values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import deepoffload
    import deepoffload.dcp

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    expected = model(torch.ones(2, 64))
    dcp.save(model.state_dict(), storage_writer=deepoffload.dcp.FileSystemWriter(scratch / "dcp"))
    assert main(["plan", str(scratch / "dcp"), "--max-memory", "2GB"]) == 1
    err = capsys.readouterr().err
    assert "(DCP) folder" in err and "dcp_to_torch_save(folder, 'model.pt')" in err, err
    dcp_to_torch_save(scratch / "dcp", scratch / "model.pt")
    assert main(["plan", str(scratch / "model.pt"), "--max-memory", "2GB"]) == 0
    assert "3 blocks" in capsys.readouterr().out
    with torch.device("meta"):
        streamed = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    off = deepoffload.offload_parameters(
        streamed, scratch / "swap", load=deepoffload.LoadOptions(checkpoint=scratch / "model.pt")
    )
    with off, torch.no_grad():
        assert torch.equal(streamed(torch.ones(2, 64)), expected.detach())
    off.close(restore=False)


def test_a_folder_whose_config_transformers_cannot_build_is_still_planned(scratch, capsys):
    """plan measures a folder with config.json as from_pretrained would hold it; a config transformers does not know
    (a model of one's own, saved beside its weights) is planned as offload_parameters' checkpoint, not a crash."""
    checkpoint(scratch)
    (scratch / "config.json").write_text('{"model_type": "not-a-transformers-model"}')
    assert main(["plan", str(scratch), "--max-memory", "64GB"]) == 0
    assert "the process now (torch imported)" in capsys.readouterr().out
