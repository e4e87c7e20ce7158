"""OffloadedOptimizer gives bit-identical results to the optimizer it wraps, for every torch.optim optimizer that
runs on CPU, with two param groups, an LR scheduler, zero_grad, parameters without gradients in some steps, and
state of any shape and dtype."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer

STEPS = 21

OPTIMIZERS = {
    "adam": functools.partial(torch.optim.Adam, lr=0.01),
    "adam-foreach": functools.partial(torch.optim.Adam, lr=0.01, foreach=True),
    "adam-fused": functools.partial(torch.optim.Adam, lr=0.01, fused=True),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
    "adamw-amsgrad": functools.partial(torch.optim.AdamW, lr=0.01, amsgrad=True),
    "adamw-amsgrad-foreach": functools.partial(torch.optim.AdamW, lr=0.01, amsgrad=True, foreach=True),
    "sgd-momentum": functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
    "sgd-nesterov-foreach": functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9, nesterov=True, foreach=True),
    "adagrad": functools.partial(torch.optim.Adagrad, lr=0.01),
    "rmsprop-centered": functools.partial(torch.optim.RMSprop, lr=0.01, centered=True, momentum=0.5),
    "adafactor": functools.partial(torch.optim.Adafactor, lr=0.01),
    "adadelta": functools.partial(torch.optim.Adadelta, lr=0.5),
    "adamax": functools.partial(torch.optim.Adamax, lr=0.01),
    "asgd": functools.partial(torch.optim.ASGD, lr=0.01, t0=5),
    "nadam": functools.partial(torch.optim.NAdam, lr=0.01),
    "radam": functools.partial(torch.optim.RAdam, lr=0.01),
    "rprop": functools.partial(torch.optim.Rprop, lr=0.01),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8), torch.nn.LayerNorm(8))


def param_groups(model):
    return [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()) + list(model[3].parameters()), "lr": 0.003},
    ]


def train(model, optimizer, steps=STEPS, start=0, closure=False):
    """Deterministic batches; the last layer's bias gets no gradient every third step, the LayerNorm never in the
    first steps (state created late)."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)

        def compute():
            optimizer.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            if step % 3 == 1:
                model[2].bias.grad = None
            if step < 3:
                for p in model[3].parameters():
                    p.grad = None
            return loss

        loss = optimizer.step(compute) if closure else (compute(), optimizer.step())[0]
        scheduler.step()
        losses.append(loss.item())
    return losses


def assert_same(model_a, model_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name


@pytest.fixture
def config(scratch):
    # tiny chunks: several chunks per step, so the pipeline (read ahead, write behind) is exercised
    return SwapConfig(folder=str(scratch), chunk_bytes=4096, buffer_count=3)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bit_identical_to_in_memory(name, config):
    make = OPTIMIZERS[name]
    reference = make_model()
    expected = train(reference, make(param_groups(reference)))
    model = make_model()
    with OffloadedOptimizer(make, param_groups(model), config) as optimizer:
        losses = train(model, optimizer)
        assert optimizer.stored_bytes() > 0
        tensors_in_memory = [k for s in optimizer.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)]
        assert tensors_in_memory == []
    assert losses == expected
    assert_same(reference, model)


def test_muon_on_matrices(config):
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8, 4))]
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    plain = torch.optim.Muon(weights, lr=0.02)
    offloaded = OffloadedOptimizer(torch.optim.Muon, copies, config, lr=0.02)
    for _ in range(STEPS):
        for params, opt in ((weights, plain), (copies, offloaded)):
            opt.zero_grad()
            (params[0] @ params[1]).sin().sum().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, copies))
    offloaded.close()


def test_closure_is_evaluated_once_and_returned(config):
    reference = make_model()
    expected = train(reference, torch.optim.Adam(param_groups(reference), lr=0.01), closure=True)
    model = make_model()
    with OffloadedOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), config=config) as optimizer:
        assert train(model, optimizer, closure=True) == expected
    assert_same(reference, model)


class OddStateSGD(torch.optim.Optimizer):
    """A hand-written optimizer whose state differs from its parameter in shape and dtype: an int8 quantised
    momentum with a float64 per-row scale, a 0-dim int64 counter, a Python float and, from step 3 on, an extra
    state of another shape (created after the first step)."""

    deepoffload_per_parameter = True  # its step reads each parameter alone

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                rows = p.reshape(p.shape[0], -1) if p.dim() else p.reshape(1, 1)
                grad = p.grad.reshape(rows.shape)
                if not state:
                    state["count"] = torch.zeros((), dtype=torch.int64)
                    state["scale"] = torch.ones(rows.shape[0], dtype=torch.float64)
                    state["q"] = torch.zeros(rows.shape, dtype=torch.int8)
                    state["norm"] = 0.0
                momentum = state["q"].to(torch.float64) * state["scale"][:, None] / 127 * 0.9 + grad
                state["scale"] = momentum.abs().amax(dim=1).clamp_min(1e-12)
                state["q"] = (momentum / state["scale"][:, None] * 127).round().to(torch.int8)
                state["count"] += 1
                state["norm"] = float(momentum.norm())
                if int(state["count"]) >= 3:
                    history = state.get("history", torch.zeros(3, 2, dtype=torch.bfloat16))
                    state["history"] = torch.roll(history, 1, 0).index_fill_(0, torch.tensor([0]), state["norm"])
                rows.sub_(momentum.to(p.dtype), alpha=group["lr"])
        return None


def test_state_of_other_shape_and_dtype_round_trips(config):
    reference = make_model()
    expected = train(reference, OddStateSGD(param_groups(reference)))
    model = make_model()
    with OffloadedOptimizer(OddStateSGD, param_groups(model), config) as optimizer:
        assert train(model, optimizer) == expected
        weight = model[0].weight
        records = optimizer.swapper.records(optimizer.pipeline.name(weight))
        assert {k: (r.dtype, r.shape) for k, r in records.items()} == {
            "count": (torch.int64, ()),
            "scale": (torch.float64, (48,)),
            "q": (torch.int8, (48, 16)),
            "history": (torch.bfloat16, (3, 2)),
        }
        assert isinstance(optimizer.state[weight]["norm"], float)  # non-tensor state stays in memory
        full = optimizer.state_dict()
    assert_same(reference, model)
    assert set(full["state"][0]) == {"count", "scale", "q", "norm", "history"}


def test_adafactor_factored_state_is_stored_with_its_own_shape(config):
    model = make_model()
    with OffloadedOptimizer(torch.optim.Adafactor, param_groups(model), config, lr=0.01) as optimizer:
        train(model, optimizer, steps=2)
        records = optimizer.swapper.records(optimizer.pipeline.name(model[0].weight))
        shapes = {k: r.shape for k, r in records.items()}
    assert shapes["row_var"] != tuple(model[0].weight.shape)
    assert shapes["step"] == ()


def test_state_dict_is_the_real_state_and_loads_back(config):
    reference = make_model()
    plain = torch.optim.AdamW(param_groups(reference), lr=0.01, amsgrad=True)
    train(reference, plain, steps=5)
    model = make_model()
    with OffloadedOptimizer(torch.optim.AdamW, param_groups(model), config, lr=0.01, amsgrad=True) as optimizer:
        train(model, optimizer, steps=5)
        ours, theirs = optimizer.state_dict(), plain.state_dict()
        assert ours["param_groups"] == theirs["param_groups"]
        assert ours["state"].keys() == theirs["state"].keys()
        for index, state in theirs["state"].items():
            assert ours["state"][index].keys() == state.keys()
            for key, value in state.items():
                assert torch.equal(ours["state"][index][key], value), (index, key)
        # load the plain optimizer's state into a fresh offloaded one: both continue identically
        other_model = make_model()
        other_model.load_state_dict(reference.state_dict())
        with OffloadedOptimizer(torch.optim.AdamW, param_groups(other_model), config, lr=0.01, amsgrad=True) as other:
            other.load_state_dict(theirs)
            assert [v for s in other.state.values() for v in s.values() if isinstance(v, torch.Tensor)] == []
            assert other.stored_bytes() == optimizer.stored_bytes()
            more = [train(other_model, other, steps=4, start=5), train(reference, plain, steps=4, start=5)]
    assert more[0] == more[1]
    assert_same(reference, other_model)


def test_existing_state_of_an_instance_is_swapped_out(config):
    model = make_model()
    inner = torch.optim.Adagrad(model.parameters(), lr=0.01)  # Adagrad creates its state in __init__
    with OffloadedOptimizer(inner, config=config) as optimizer:
        assert optimizer.stored_bytes() == sum(p.numel() * 4 + 4 for p in model.parameters())
        assert all(not s for s in inner.state.values())


def test_refuses_lbfgs_and_bad_arguments(config):
    model = make_model()
    with pytest.raises(TypeError, match="LBFGS"):
        OffloadedOptimizer(torch.optim.LBFGS, model.parameters(), config)
    with pytest.raises(TypeError, match="needs params"):
        OffloadedOptimizer(torch.optim.Adam)
    with pytest.raises(TypeError, match="not both"):
        OffloadedOptimizer(torch.optim.Adam(model.parameters()), model.parameters())
    with pytest.raises(TypeError, match="instance or class"):
        OffloadedOptimizer("adam", model.parameters())
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        OffloadedOptimizer(lambda params: object(), model.parameters())


def test_failed_write_keeps_state_in_memory_and_raises(config, monkeypatch):
    model = make_model()
    optimizer = OffloadedOptimizer(torch.optim.Adam, param_groups(model), config, lr=0.01)
    train(model, optimizer, steps=2)
    real_write = optimizer.swapper.handle.write_async

    def failing(tensor, file, *args, **kwargs):
        return real_write(tensor, "/nonexistent-folder/x.swp", *args, **kwargs)

    monkeypatch.setattr(optimizer.swapper.handle, "write_async", failing)
    with pytest.raises(OSError) as info:
        train(model, optimizer, steps=1, start=2)
    assert "/nonexistent-folder/x.swp" in str(info.value)
    resident = {k for s in optimizer.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)}
    assert resident == {"step", "exp_avg", "exp_avg_sq"}
    monkeypatch.undo()
    # training carries on from the resident state, identical to a run that never failed
    reference = make_model()
    plain = torch.optim.Adam(param_groups(reference), lr=0.01)
    train(reference, plain, steps=2)
    train(reference, plain, steps=1, start=2)  # the failed step was completed in memory
    assert_same(reference, model)
    assert train(model, optimizer, steps=2, start=3) == train(reference, plain, steps=2, start=3)
    assert [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)] == []
    assert_same(reference, model)
    optimizer.close()


def test_many_small_parameters_reuse_plans_and_stay_identical(config):
    """Hundreds of tiny parameters over several chunks: plans and views are reused between steps, yet a change of
    which parameters have gradients, a new param group and a state_dict round trip all give the plain results."""

    def params(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(5, generator=gen)) for _ in range(300)]

    def run(optimizer, ps, extra):
        for step in range(9):
            gen = torch.Generator().manual_seed(100 + step)
            for i, p in enumerate(ps):
                p.grad = None if (step == 4 and i % 7 == 0) else torch.randn(5, generator=gen)
            if step == 6:
                optimizer.add_param_group({"params": extra, "lr": 0.002})
            for p in extra:
                p.grad = torch.randn(5, generator=gen) if step >= 6 else None
            optimizer.step()
            if step == 7:
                optimizer.load_state_dict(optimizer.state_dict())

    ref, ref_extra = params(0), params(1)[:20]
    run(torch.optim.Adam(ref, lr=0.01), ref, ref_extra)
    mine, mine_extra = params(0), params(1)[:20]
    with OffloadedOptimizer(torch.optim.Adam, mine, config, lr=0.01) as optimizer:
        run(optimizer, mine, mine_extra)
        assert len(optimizer.pipeline.chunks([p for p in optimizer.pipeline.params()])) > 3  # several chunks of 4 KiB
        stored = optimizer.stored_bytes()
        size = os.path.getsize(os.path.join(optimizer.swapper.folder, "pack.swp"))
        chunks = len({id(e) for e in optimizer.swapper.packing.extents.values()})
    for a, b in zip(ref + ref_extra, mine + mine_extra):
        assert torch.equal(a, b)
    # each chunk's extent is page-aligned; inside it the small tensors pack at 16 bytes, not 64
    assert size <= 1.1 * stored + chunks * 4096


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "step_in_backward"])
def test_parameters_larger_than_a_chunk_reuse_pooled_buffers(config, in_backward):
    """A parameter whose state exceeds chunk_bytes steps from a pooled buffer grown to its size, the same buffers
    in every later step (a fresh buffer per step faults its pages in during the read), with the plain results."""

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Tanh(), torch.nn.Linear(60, 30))

    def run(net, optimizer, steps=5, settled=None):
        for step in range(steps):
            x = torch.randn(8, 40, generator=torch.Generator().manual_seed(step))
            net(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1 and settled is not None:  # the first step creates the state, the second reads it
                settled()

    reference = model()
    run(reference, torch.optim.AdamW(reference.parameters(), lr=0.01))
    mine = model()
    largest = max(8 * p.numel() for p in mine.parameters())
    assert largest > config.chunk_bytes  # the weights' state does not fit a chunk
    one_offs, buffers = [], set()
    with OffloadedOptimizer(torch.optim.AdamW, mine.parameters(), config, lr=0.01) as optimizer:
        if in_backward:
            optimizer.step_in_backward()
        pool = optimizer.swapper.pool
        one_off = pool.one_off

        def counted(nbytes):
            one_offs.append(nbytes)
            return one_off(nbytes)

        def watch():
            one_offs.clear()
            pool.one_off = counted
            buffers.update(pool._pooled)

        run(mine, optimizer, settled=watch)
        assert one_offs == []
        assert pool.buffer_bytes >= largest
        assert set(pool._pooled) <= buffers  # no buffer made in the later steps
        assert pool.held_bytes() <= config.buffer_count * pool.buffer_bytes
    for a, b in zip(reference.parameters(), mine.parameters()):
        assert torch.equal(a, b)
