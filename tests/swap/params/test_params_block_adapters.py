"""Block adapters: a toy adapter registered from this file alone teaches ``find_blocks`` a model whose blocks sit in a
custom container (an ``nn.ModuleDict`` subclass that runs them in an order of its own), and that model streams and
trains through ``offload_parameters`` bit-identically to the same model in memory; then it is unregistered."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from deepoffload import TrainOptions
from deepoffload.swap.params import find_blocks, offload_parameters
from deepoffload.swap.params.blocks.adapters import Child, adapters, register_adapter, unregister_adapter


class Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stages(nn.ModuleDict):
    """Layers kept by name, run in ``order`` (not the order they were added): no rule of thumb finds them."""

    def __init__(self, layers: dict[str, nn.Module], order: list[str]):
        super().__init__(layers)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.order:
            x = self[name](x)
        return x


class Model(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.stages = Stages({k: Layer(width) for k in ("c", "a", "b")}, order=["a", "c", "b"])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.embed(x)))


class StagesAdapter:
    """The toy: a ``Stages`` holds blocks, in its run order; a ``Layer`` streams its parameters in reverse order."""

    name = "toy-stages"

    def children(self, module: nn.Module) -> list[Child] | None:
        if not isinstance(module, Stages):
            return None
        return [Child(name, module[name], True) for name in module.order]

    def parameters(self, block: nn.Module) -> list[tuple[str, nn.Parameter]] | None:
        return list(reversed(list(block.named_parameters()))) if isinstance(block, Layer) else None


@pytest.fixture
def toy_adapter():
    register_adapter(StagesAdapter())
    try:
        yield
    finally:
        unregister_adapter(StagesAdapter.name)
    assert [a.name for a in adapters()] == ["sequences"]


def test_blocks_in_a_custom_container_are_not_found_without_the_adapter():
    assert find_blocks(Model()) == []


def test_the_adapter_finds_the_blocks_in_their_run_order(toy_adapter):
    assert [name for name, _ in find_blocks(Model())] == ["stages.a", "stages.c", "stages.b"]


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_a_model_found_by_the_adapter_trains_bit_identically_to_memory(scratch, toy_adapter, mode):
    torch.manual_seed(0)
    reference = Model()
    model = copy.deepcopy(reference)
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    optimizer = make(reference.parameters())
    inputs = [torch.randn(5, 8) for _ in range(3)]
    with offload_parameters(model, str(scratch), train=TrainOptions(make, mode=mode)) as off:
        assert [b.prefix for b in off.blocks] == ["stages.a", "stages.c", "stages.b"]
        assert off.blocks[0].names == ["down.bias", "down.weight", "up.bias", "up.weight", "norm.bias", "norm.weight"]
        for x in inputs:
            loss = reference(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            streamed = model(x).square().mean()
            streamed.backward()
            off.step()
            off.zero_grad()
            assert torch.equal(streamed, loss)
        assert off.stats.bytes_read > 0  # the blocks did stream
        with torch.no_grad():
            assert torch.equal(model(inputs[0]), reference(inputs[0]))
        state = off.state_dict()
    assert state.keys() == reference.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_the_registry_refuses_a_second_adapter_of_a_name_and_an_unknown_name(toy_adapter):
    with pytest.raises(ValueError, match="toy-stages"):
        register_adapter(StagesAdapter())
    with pytest.raises(KeyError, match="no block adapter named 'missing'"):
        unregister_adapter("missing")
    with pytest.raises(KeyError):
        unregister_adapter("sequences")  # the default stays


class Dropping(StagesAdapter):
    name = "toy-dropping"

    def parameters(self, block: nn.Module) -> list[tuple[str, nn.Parameter]] | None:
        return list(block.named_parameters())[1:] if isinstance(block, Layer) else None


def test_an_adapter_that_leaves_a_parameter_out_is_refused_at_offload(scratch):
    register_adapter(Dropping())
    try:
        with pytest.raises(ValueError, match="toy-dropping.*each of the block's parameters once"):
            offload_parameters(Model(), str(scratch))
    finally:
        unregister_adapter(Dropping.name)
