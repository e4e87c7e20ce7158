"""The checkpoint format registry: every built-in format through it, the docs' table equal to it, and a toy format
registered from this file alone (a folder of raw tensor files named by a small JSON file) that loads end to end
through ``CheckpointReader``, ``load_file``, ``offload_parameters(checkpoint=...)`` and ``deepoffload plan``."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from deepoffload import LoadOptions
from deepoffload.cli.main import main
from deepoffload.errors import CheckpointError, CheckpointNotFoundError, UnsupportedError
from deepoffload.formats import (
    CheckpointFormat,
    CheckpointReader,
    OpenedCheckpoint,
    checkpoint_formats,
    detect_format,
    get_format,
    load_file,
    raw_file,
    register_format,
    unregister_format,
)
from deepoffload.formats.header import file_identity
from deepoffload.swap.params import offload_parameters

DOCS = Path(__file__).resolve().parents[2] / "docs" / "guides" / "checkpoints.md"
HEADER = "toy.json"


class ToyFormat(CheckpointFormat):
    """A folder holding ``toy.json`` ({name: [file, dtype, shape, byte offset]}) and the raw files it names."""

    name = "toy"
    description = "a folder of raw tensor files named by toy.json"
    writes = True

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / HEADER).is_file()

    def open(self, path: Path) -> OpenedCheckpoint:
        layout = json.loads((path / HEADER).read_text())
        by_file: dict[str, dict] = {}
        for name, (file, dtype, shape, offset) in layout.items():
            by_file.setdefault(file, {})[name] = (getattr(torch, dtype), tuple(shape), offset)
        return OpenedCheckpoint(files=tuple(raw_file(path / file, tensors) for file, tensors in by_file.items()))

    def save(self, tensors, path) -> None:
        """Two files; tensors packed back to back with a 3-byte gap after each (offsets not element-aligned)."""
        folder = Path(path)
        folder.mkdir(exist_ok=True)
        layout, files = {}, {"a.raw": bytearray(), "b.raw": bytearray()}
        for i, (name, tensor) in enumerate(tensors.items()):
            file = "a.raw" if i % 2 == 0 else "b.raw"
            data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            layout[name] = [file, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), len(files[file])]
            files[file] += data + b"\x00\x01\x02"
        for file, data in files.items():
            (folder / file).write_bytes(bytes(data))
        (folder / HEADER).write_text(json.dumps(layout))


@pytest.fixture
def toy():
    fmt = register_format(ToyFormat())
    try:
        yield fmt
    finally:
        unregister_format("toy")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def test_toy_format_loads_end_to_end_through_the_registry_alone(toy, scratch, capsys):
    torch.manual_seed(0)
    reference = Net()
    state = {**reference.state_dict(), "extra.half": torch.arange(5, dtype=torch.float16)}
    toy.save(state, scratch / "toy")
    assert detect_format(scratch / "toy") is toy

    with CheckpointReader(scratch / "toy") as reader:
        assert reader.format == "toy" and sorted(reader.names()) == sorted(state)
        assert reader.shape_dtype("extra.half") == ((5,), torch.float16)
        read = reader.read()
        assert all(torch.equal(read[name], state[name]) for name in state)
        targets = {name: torch.empty_like(t) for name, t in state.items()}
        reader.read_into(targets)
        assert all(torch.equal(targets[name], state[name]) for name in state)
    loaded = load_file(scratch / "toy", dtype=torch.bfloat16, names=["head.weight"])
    assert torch.equal(loaded["head.weight"], state["head.weight"].to(torch.bfloat16))

    del state["extra.half"]
    toy.save(state, scratch / "toy")
    with torch.device("meta"):
        model = Net()
    x = torch.randn(2, 8)
    with offload_parameters(model, str(scratch / "swap"), load=LoadOptions(checkpoint=scratch / "toy")) as off:
        assert off.load_report == ([], [])
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))

    assert main(["plan", str(scratch / "toy"), "--max-memory", "64GB"]) == 0
    out = capsys.readouterr().out
    assert "3 blocks" in out and "toy" in out


def test_from_pretrained_reads_a_folder_whose_weights_are_in_the_toy_format(toy, scratch):
    import deepoffload

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    config.save_pretrained(scratch / "llama")
    toy.save(reference.state_dict(), scratch / "llama")  # config.json beside toy.json: no safetensors at all
    ids = torch.randint(0, 64, (1, 12))
    model, off = deepoffload.from_pretrained(
        scratch / "llama", transformers.LlamaForCausalLM, path=str(scratch / "swap")
    )
    with off, torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_toy_format_is_gone_once_unregistered(scratch):
    fmt = register_format(ToyFormat())
    fmt.save({"w": torch.ones(3)}, scratch / "toy")
    assert CheckpointReader(scratch / "toy").format == "toy"
    assert unregister_format("toy") is fmt
    assert "toy" not in [f.name for f in checkpoint_formats()]
    with pytest.raises(CheckpointNotFoundError, match="no model.safetensors.index.json or model.safetensors"):
        CheckpointReader(scratch / "toy")
    with pytest.raises(KeyError, match="no checkpoint format named 'toy'"):
        unregister_format("toy")


def test_toy_file_changed_after_open_is_refused(toy, scratch):
    toy.save({"w": torch.ones(1000), "v": torch.zeros(10)}, scratch / "toy")
    with CheckpointReader(scratch / "toy") as reader:
        os.truncate(scratch / "toy" / "a.raw", 100)
        with pytest.raises(CheckpointError, match="changed|replaced|rewritten"):
            reader.read(["w"])


def test_raw_file_refuses_a_tensor_past_the_end(scratch):
    (scratch / "short.raw").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match=r"'w'.*runs past the end of the 10-byte file"):
        raw_file(scratch / "short.raw", {"w": (torch.float32, (3,), 0)})


def test_a_tensor_named_in_two_files_is_refused(scratch):
    for file in ("a.raw", "b.raw"):
        (scratch / file).write_bytes(bytes(8))
    a = raw_file(scratch / "a.raw", {"w": (torch.float32, (2,), 0)})
    b = raw_file(scratch / "b.raw", {"w": (torch.float32, (2,), 0)})
    with pytest.raises(CheckpointError, match=r"'w' is in both .*a\.raw and .*b\.raw"):
        OpenedCheckpoint(files=(a, b))
    with pytest.raises(ValueError, match="not both"):
        OpenedCheckpoint(files=(a,), mapped={"w": torch.ones(2)})


class MappedToy(CheckpointFormat):
    """A folder holding inner.pt: mapped tensors from a file that is not the path given."""

    name, description = "mapped-toy", "a folder holding inner.pt"

    def detect(self, path: Path) -> bool:
        return (path / "inner.pt").is_file()

    def open(self, path: Path) -> OpenedCheckpoint:
        inner = path / "inner.pt"
        identity = file_identity(os.stat(inner))
        state = torch.load(inner, mmap=True, weights_only=True)
        return OpenedCheckpoint(mapped=state, mapped_path=str(inner), mapped_identity=identity)


def test_mapped_tensors_are_checked_against_their_own_file(scratch):
    (scratch / "m").mkdir()
    torch.save({"w": torch.arange(6.0)}, scratch / "m" / "inner.pt")
    register_format(MappedToy())
    try:
        with CheckpointReader(scratch / "m") as reader:
            assert reader.format == "mapped-toy" and torch.equal(reader.read()["w"], torch.arange(6.0))
            torch.save({"w": torch.zeros(6)}, scratch / "m" / "inner.pt")
            with pytest.raises(CheckpointError, match="inner.pt was replaced or rewritten"):
                reader.read()
    finally:
        unregister_format("mapped-toy")
    with pytest.raises(ValueError, match="mapped_path and mapped_identity"):
        OpenedCheckpoint(mapped={"w": torch.ones(1)})


def test_registering_checks_its_input(toy):
    with pytest.raises(ValueError, match="named 'toy' is registered already"):
        register_format(ToyFormat())
    with pytest.raises(TypeError, match="CheckpointFormat instance"):
        register_format("toy")  # type: ignore[arg-type]
    assert checkpoint_formats()[0] is toy  # tried before the built-in ones


@pytest.mark.parametrize("fmt", [f for f in checkpoint_formats() if f.writes], ids=lambda f: f.name)
def test_each_writing_format_reads_back_what_it_saved(fmt, scratch):
    tensors = {f"w{i}": torch.randn(64, 3) for i in range(3)}
    path = scratch / "out"
    fmt.save(tensors, path)
    found = detect_format(path)  # one shard is written as model.safetensors, as Hugging Face writes it
    assert found is fmt or (fmt.name, found.name) == ("safetensors-sharded", "safetensors")
    with CheckpointReader(path) as reader:
        assert reader.format == found.name and reader.serves == found.serves
        assert all(torch.equal(reader.read([n])[n], t) for n, t in tensors.items())


@pytest.mark.parametrize("fmt", [f for f in checkpoint_formats() if not f.writes], ids=lambda f: f.name)
def test_a_format_that_does_not_write_says_so(fmt, scratch):
    with pytest.raises(UnsupportedError, match=f"does not write the {fmt.name} checkpoint format"):
        fmt.save({"w": torch.ones(1)}, scratch / "out")


def test_docs_table_is_the_registry():
    text = DOCS.read_text()
    section = text.split("<!-- formats table -->\n")[1]
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), section.splitlines()))[2:]
    table = [tuple(cell.strip().strip("`") for cell in row.strip("|").split("|")) for row in rows]
    expected = [(f.name, f.description, "yes" if f.writes else "no") for f in checkpoint_formats()]
    assert len(table) == 4
    assert table == expected


def test_plan_help_and_report_list_every_format(toy, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = re.sub(r"\s+", "", capsys.readouterr().out)  # (argparse wraps at hyphens too)
    assert all((f"({f.name})" in out) == f.reads for f in checkpoint_formats())
    main(["report", "--json"])
    listed = json.loads(capsys.readouterr().out)["checkpoint_formats"]
    assert [f["name"] for f in listed] == [f.name for f in checkpoint_formats()] and listed[0]["name"] == "toy"
    main(["report"])
    out = capsys.readouterr().out
    assert all(f.description in out for f in checkpoint_formats())


def test_builtin_formats_are_found_by_their_name():
    assert [f.name for f in checkpoint_formats()] == ["safetensors-sharded", "torch", "safetensors", "dcp"]
    assert get_format("dcp").name == "dcp"


def test_listing_the_formats_imports_no_torch():
    """``deepoffload report`` and the CLI's parser list the formats; neither may import torch to do it."""
    code = (
        "import sys; from deepoffload.cli.main import build_parser; from deepoffload.cli.report import "
        "checkpoint_format_rows; build_parser(); rows = checkpoint_format_rows(); "
        "print('torch' in sys.modules, len(rows))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", str(len(checkpoint_formats()))], proc.stderr
