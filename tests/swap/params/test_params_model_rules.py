"""Model rules (``deepoffload/swap/params/setup/model_rules.py``): toy rules registered from this file alone give a
model of its own family its checkpoint names, a parameter kept in float32 and its own initializer, end to end through
``offload_parameters``; and transformers' rules, which live under ``deepoffload/integrations/hugging_face/``, are found
by name in a fresh process for a transformers model (and only for one) without the user importing them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from deepoffload.formats.checks import KeyReport
from deepoffload.swap.params import offload_parameters
from deepoffload.swap.params.options import LoadOptions
from deepoffload.swap.params.setup.model_rules import (
    DEFAULT,
    ModelRules,
    register_rules,
    rules_for,
    unregister_rules,
)

ROOT = Path(__file__).resolve().parents[3]


class Toy(nn.Module):
    """A model whose checkpoints store every name under ``old.`` (its family's convention)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.scale = nn.Parameter(torch.ones(4))  # kept in float32 by the family's rules
        self.extra = nn.Linear(4, 4)  # no checkpoint holds it: the family's initializer gives it values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.extra(x * self.scale.to(x.dtype))


class Renamed:
    """A checkpoint seen in the model's names: ``old.<name>`` stored, ``<name>`` asked."""

    def __init__(self, reader):
        self.reader, self.path = reader, reader.path

    def __contains__(self, name: str) -> bool:
        return "old." + name in self.reader

    def check(self, expected, strict: bool = True) -> KeyReport:
        report = self.reader.check({"old." + n: v for n, v in expected.items()}, strict=strict)
        return KeyReport([n[4:] for n in report.missing], list(report.unexpected))

    def location(self, name: str):
        return self.reader.location("old." + name)

    def read_into(self, destinations) -> None:
        self.reader.read_into({"old." + n: t for n, t in destinations.items()})

    def close(self) -> None:
        self.reader.close()


def fill_extra(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.constant_(module.weight, 0.5)
        nn.init.zeros_(module.bias)


class ToyRules(ModelRules):
    name = "toy"

    def claims(self, module):
        return isinstance(module, Toy)

    def checkpoint(self, reader, module):
        return Renamed(reader)

    def missing_allowed(self, module, missing):
        return {n for n in missing if n.startswith("extra.")}

    def kept_in_float32(self, module, dtype):
        return {id(module.scale)}

    def init_function(self, module):
        return fill_extra


@pytest.fixture
def toy_rules():
    register_rules(ToyRules())
    try:
        yield
    finally:
        unregister_rules("toy")


def test_toy_rules_load_a_model_of_their_family(tmp_path, toy_rules):
    torch.manual_seed(0)
    source = Toy()
    stored = {f"old.{n}": t.detach().clone() for n, t in source.state_dict().items() if not n.startswith("extra.")}
    save_file(stored, tmp_path / "toy.safetensors")
    with torch.device("meta"):
        model = Toy()
    assert rules_for(model).name == "toy" and rules_for(nn.Linear(2, 2)) is DEFAULT
    load = LoadOptions(checkpoint=tmp_path / "toy.safetensors", dtype=torch.bfloat16, strict=False)
    off = offload_parameters(model, tmp_path / "swap", load=load)
    try:
        state = model.state_dict()
        for name, value in stored.items():
            assert torch.equal(state[name[4:]].float(), value.to(torch.bfloat16).float()), name
        assert model.scale.dtype == torch.float32 and model.layers[0].weight.dtype == torch.bfloat16
        assert torch.equal(model.extra.weight, torch.full((4, 4), 0.5, dtype=torch.bfloat16))
    finally:
        off.close()


def test_register_twice_is_refused(toy_rules):
    with pytest.raises(ValueError, match="toy"):
        register_rules(ToyRules())


FRESH = """
import contextlib, io, sys, torch, transformers
from deepoffload.swap.params import offload_parameters
from deepoffload.swap.params.options import LoadOptions
plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
off = offload_parameters(plain, "plain")
off.close()
assert "deepoffload.integrations.hugging_face.rules" not in sys.modules  # not for a model of no known family
config = transformers.GPTNeoXConfig(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
)
source = transformers.GPTNeoXForCausalLM(config).eval()
with contextlib.redirect_stdout(io.StringIO()):
    source.save_pretrained("neox")
with torch.device("meta"):
    model = transformers.GPTNeoXForCausalLM(config)
off = offload_parameters(model, "swap", load=LoadOptions(checkpoint="neox"))  # its checkpoint names lm_head embed_out
assert "deepoffload.integrations.hugging_face.rules" in sys.modules
x = torch.tensor([[1, 2, 3]])
with torch.no_grad():
    assert torch.equal(model.eval()(x).logits, source(x).logits)
off.close()
print("ok")
"""


def test_transformers_rules_found_by_name_in_a_fresh_process(tmp_path):
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", FRESH], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
