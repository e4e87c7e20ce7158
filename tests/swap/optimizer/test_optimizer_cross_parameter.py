"""Optimizers whose step reads several parameters (a global gradient norm): stepped chunk by chunk, each call saw
one chunk's parameters and the result changed silently once the state needed more than one chunk. Now only torch's
built-in classes are known per-parameter; another is refused unless declared, and ``per_parameter=False`` steps it
over all parameters at once, equal to memory."""

from __future__ import annotations

import pytest
import torch

from deepoffload import OffloadedOptimizer, SwapConfig
from deepoffload.errors import StreamedParameterError, UnsupportedError
from deepoffload.swap.optimizer_budget import fit_buffers


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD on gradients divided by their global norm over all parameters (reads every parameter in one step)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["momentum"] = state.get("momentum", torch.zeros_like(p)) * 0.9 + p.grad / norm
                    p.add_(state["momentum"], alpha=-group["lr"])


def params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 16, generator=gen)) for _ in range(6)]


def train(ps, opt, steps=3):
    for k in range(steps):
        gen = torch.Generator().manual_seed(100 + k)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.fixture
def config(scratch):
    return SwapConfig(folder=str(scratch), chunk_bytes=4096)  # one parameter's state per chunk


def test_an_undeclared_optimizer_is_refused_naming_both_declarations(config):
    class Subclass(torch.optim.Adam):  # a subclass may step otherwise
        pass

    for make in (GlobalNormSGD, Subclass):
        with pytest.raises(UnsupportedError, match="per_parameter=True.*per_parameter=False"):
            OffloadedOptimizer(make, params(), config)


class BetasAdam(torch.optim.Adam):
    """A subclass of a built-in one that only changes its defaults (``__init__``): refused until declared."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, lr=lr, betas=(0.8, 0.95))


@pytest.mark.parametrize("declare", ["argument", "attribute"])
def test_a_subclass_declared_as_the_refusal_says_steps_equal_to_memory(config, declare, monkeypatch):
    with pytest.raises(UnsupportedError, match="BetasAdam.deepoffload_per_parameter = True"):
        OffloadedOptimizer(BetasAdam, params(), config)
    reference = params()
    train(reference, BetasAdam(reference))
    ps = params()
    if declare == "attribute":
        monkeypatch.setattr(BetasAdam, "deepoffload_per_parameter", True, raising=False)
    kwargs = {"per_parameter": True} if declare == "argument" else {}
    with OffloadedOptimizer(BetasAdam, ps, config, **kwargs) as opt:  # one parameter's state per chunk
        train(ps, opt)
        assert opt.stored_bytes() > 0
    assert all(torch.equal(a, b) for a, b in zip(reference, ps))


def test_per_parameter_false_steps_all_at_once_equal_to_memory(config):
    reference = params()
    train(reference, GlobalNormSGD(reference))
    ps = params()
    with OffloadedOptimizer(GlobalNormSGD, ps, config, per_parameter=False) as opt:
        train(ps, opt)
        assert opt.stored_bytes() > 0
        with pytest.raises(UnsupportedError, match="all parameters at once.*step\\(\\) after backward"):
            opt.step_in_backward()
    assert all(torch.equal(a, b) for a, b in zip(reference, ps))


def test_chunk_by_chunk_would_differ(config):
    """Why it is refused: declared per-parameter falsely, the chunks (one parameter each) change the result."""
    reference = params()
    train(reference, GlobalNormSGD(reference))
    ps = params()
    with OffloadedOptimizer(GlobalNormSGD, ps, config, per_parameter=True) as opt:
        train(ps, opt)
    assert not all(torch.equal(a, b) for a, b in zip(reference, ps))


def test_max_memory_plans_the_whole_state_in_one_buffer():
    ps = params()
    config = SwapConfig(chunk_bytes=1 << 20)
    limit = (1 << 30) + (256 << 20)
    chunked = fit_buffers(ps, limit, 1 << 30, config)
    whole = fit_buffers(ps, limit, 1 << 30, config, whole=True)
    assert chunked.chunk_bytes >= 2 * 16 * 16 * 4 and whole.chunk_bytes >= 2 * 6 * 16 * 16 * 4


def test_offload_parameters_refuses_an_optimizer_declared_cross_parameter(scratch):
    from deepoffload import TrainOptions
    from deepoffload.swap.params import offload_parameters

    class Declared(GlobalNormSGD):
        deepoffload_per_parameter = False

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StreamedParameterError, match="block by block.*per_parameter=False"):
        offload_parameters(model, str(scratch), train=TrainOptions(optimizer=lambda ps: Declared(ps)))
    with pytest.raises(UnsupportedError, match="per_parameter=True"):
        offload_parameters(model, str(scratch), train=TrainOptions(optimizer=lambda ps: GlobalNormSGD(ps)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the model is left as it was"
    model(torch.ones(2, 8)).sum().backward()


class DeclaredSGD(torch.optim.Optimizer):
    """A per-parameter optimizer that declares it."""

    deepoffload_per_parameter = True

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class NormalizedSGD(DeclaredSGD):
    """Replaces the declared class's step with one that reads every gradient (its global norm)."""

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for g in grads:
            g.div_(norm)
        super().step()


class SlowerSGD(DeclaredSGD):
    """Changes only the defaults: the declared step is the one it runs."""

    def __init__(self, params):
        super().__init__(params, lr=0.01)


def test_a_declaration_does_not_cover_a_subclass_that_replaces_step(config):
    """An inherited ``deepoffload_per_parameter = True`` holds for the step it was declared with, not a new one."""
    for _ in range(2):  # (torch's hook wrapper goes on SlowerSGD first, then it is on the classes)
        with pytest.raises(UnsupportedError, match="NormalizedSGD is not one of torch's built-in"):
            OffloadedOptimizer(NormalizedSGD, params(), config)
        for make in (SlowerSGD, DeclaredSGD):
            reference, ps = params(), params()
            train(reference, make(reference))
            with OffloadedOptimizer(make, ps, config) as opt:
                train(ps, opt)
            assert all(torch.equal(a, b) for a, b in zip(reference, ps))
    reference, ps = params(), params()  # declared where it is built, as the refusal says: exact
    train(reference, NormalizedSGD(reference))
    with OffloadedOptimizer(NormalizedSGD, ps, config, per_parameter=False) as opt:
        train(ps, opt)
    assert all(torch.equal(a, b) for a, b in zip(reference, ps))
