"""OffloadedOptimizer keeps the torch.optim.Optimizer contract: pickling and copying refuse at once, step and
state-dict hooks fire once with the wrapper, double wrapping and closure-requiring optimizers are refused at
construction, a failing step leaves each parameter fully stepped or untouched and says which, and checksums need no
numpy."""

from __future__ import annotations

import copy
import io
import pickle
import signal

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer
from deepoffload.swap.tensor_swapper import ChecksumError


@pytest.fixture
def config(scratch):
    return SwapConfig(folder=str(scratch), chunk_bytes=4096, buffer_count=3)  # several chunks per step


def make_params(count: int = 6, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 16, generator=gen)) for _ in range(count)]  # 2 KiB of Adam state each


def set_grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_pickle_deepcopy_and_torch_save_refuse_at_once(config):
    params = make_params()
    with OffloadedOptimizer(torch.optim.Adam, params, config, lr=0.01) as opt:
        set_grads(params, 0)
        opt.step()
        for attempt in (
            lambda: pickle.dumps(opt),
            lambda: copy.deepcopy(opt),
            lambda: copy.copy(opt),
            lambda: torch.save(opt, io.BytesIO()),
        ):
            with pytest.raises(TypeError, match=r"state_dict\(\)"):
                attempt()
        torch.save(opt.state_dict(), io.BytesIO())  # what the message says to do works


def test_step_hooks_fire_once_per_step_with_the_wrapper(config):
    params = make_params()
    opt = OffloadedOptimizer(torch.optim.Adam, params, config, lr=0.01)
    seen = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("global-pre", o))),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append(("global-post", o))),
        opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", o))),
        opt.register_step_post_hook(lambda o, a, k: seen.append(("post", o))),
    ]
    try:
        for step in range(2):
            set_grads(params, step)
            opt.step()
            assert len(opt.pipeline.chunks(params)) > 1, "several chunks, so a per-chunk hook would show"
    finally:
        for handle in handles:
            handle.remove()
        opt.close()
    assert [kind for kind, _ in seen] == ["global-pre", "pre", "post", "global-post"] * 2
    assert all(o is opt for _, o in seen)


def test_state_dict_hooks_on_the_wrapper_fire(config):
    params = make_params()
    opt = OffloadedOptimizer(torch.optim.Adam, params, config, lr=0.01)
    set_grads(params, 0)
    opt.step()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("save-pre", o)))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append(("save-post", o)) or {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load-pre", o, sd.get("extra"))))
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load-post", o)))
    saved = opt.state_dict()
    assert saved["extra"] == 1 and torch.is_tensor(saved["state"][0]["exp_avg"])
    opt.load_state_dict(saved)
    assert calls == [("save-pre", opt), ("save-post", opt), ("load-pre", opt, 1), ("load-post", opt)]
    opt.close()


def test_wrapping_a_wrapped_optimizer_or_one_with_its_own_step_hooks_is_refused(config):
    params = make_params()
    inner = torch.optim.Adam(params, lr=0.01)
    first = OffloadedOptimizer(inner, config=config)
    with pytest.raises(TypeError, match="already wrapped"):
        OffloadedOptimizer(inner, config=config)
    first.close()
    with pytest.raises(TypeError, match="already wrapped"):  # closed: its state is gone, a re-wrap would reset it
        OffloadedOptimizer(inner, config=config)
    with pytest.raises(TypeError, match="already offloaded"):
        OffloadedOptimizer(OffloadedOptimizer(torch.optim.Adam, make_params(), config), config=config)
    hooked = torch.optim.Adam(make_params(), lr=0.01)
    hooked.register_step_post_hook(lambda o, a, k: None)
    with pytest.raises(TypeError, match="register them on the OffloadedOptimizer"):
        OffloadedOptimizer(hooked, config=config)


class NeedsClosure(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure):
        return closure()


def test_closure_requiring_optimizers_are_refused_at_construction(config):
    for make in (torch.optim.LBFGS, NeedsClosure):
        with pytest.raises(TypeError, match="requires a closure"):
            OffloadedOptimizer(make, make_params(), config)


def test_sparse_gradients_with_momentum_step_fully_and_identically(config):
    """SGD keeps a sparse momentum for sparse gradients: it stays in memory, the rest is stored."""

    def build():
        torch.manual_seed(0)
        return torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 8)

    def run(emb, lin, opt):
        for step in range(4):
            idx = torch.tensor([step, step + 3, 7])
            lin(emb(idx)).square().sum().backward()
            opt.step()
            opt.zero_grad()

    ref_emb, ref_lin = build()
    run(ref_emb, ref_lin, torch.optim.SGD([*ref_emb.parameters(), *ref_lin.parameters()], lr=0.1, momentum=0.9))
    emb, lin = build()
    with OffloadedOptimizer(
        torch.optim.SGD, [*emb.parameters(), *lin.parameters()], config, lr=0.1, momentum=0.9
    ) as opt:
        run(emb, lin, opt)
        assert opt.state[emb.weight]["momentum_buffer"].is_sparse
        assert opt.swapper.has(opt.pipeline.name(lin.weight))
    assert torch.equal(emb.weight, ref_emb.weight) and torch.equal(lin.weight, ref_lin.weight)


def test_error_inside_the_wrapped_step_leaves_parameters_stepped_or_untouched_and_says_which(config):
    """Adam refuses a sparse gradient in the chunk holding it: the chunks before it are stepped, the rest not."""
    params = make_params(5)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = OffloadedOptimizer(torch.optim.Adam, [*params, emb.weight], config, lr=0.01)
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.Adam(plain_params, lr=0.01)
    set_grads(params, 0), set_grads(plain_params, 0)
    emb(torch.tensor([1])).sum().backward()
    before = [p.detach().clone() for p in params]
    plain.step()
    chunks = opt.pipeline.chunks([*params, emb.weight])
    with pytest.raises(RuntimeError, match="sparse") as info:
        opt.step()
    stepped = sum(len(c) for c in chunks[:-1])
    assert 0 < stepped < len(params) + 1
    note = " ".join(getattr(info.value, "__notes__", []))
    assert f"parameters 0-{stepped - 1} " in note and "were fully stepped" in note and "were not stepped" in note
    for i, p in enumerate(params):
        assert torch.equal(p, plain_params[i] if i < stepped else before[i]), i
    opt.close()


def test_failed_read_leaves_the_rest_untouched_and_says_which(config):
    params = make_params(6)
    opt = OffloadedOptimizer(torch.optim.Adam, params, config.replace(checksum=True), lr=0.01)
    set_grads(params, 0)
    opt.step()
    victim = params[4]
    record = next(iter(opt.swapper.records(opt.pipeline.name(victim)).values()))
    with open(record.file, "r+b") as f:
        f.seek(record.offset)
        byte = f.read(1)
        f.seek(record.offset)
        f.write(bytes([byte[0] ^ 1]))
    set_grads(params, 1)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ChecksumError) as info:
        opt.step()
    chunks = opt.pipeline.chunks(params)
    failed = next(k for k, c in enumerate(chunks) if any(p is victim for p in c))
    untouched = {id(p) for c in chunks[failed:] for p in c}
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "were not stepped" in note
    for p, b in zip(params, before):
        assert torch.equal(p, b) == (id(p) in untouched)
    opt.close()


def test_checksums_need_no_numpy(config, monkeypatch):
    def no_numpy(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    params, plain_params = make_params(), make_params()
    plain = torch.optim.Adam(plain_params, lr=0.01)
    with OffloadedOptimizer(torch.optim.Adam, params, config.replace(checksum=True), lr=0.01) as opt:
        for step in range(3):
            set_grads(params, step), set_grads(plain_params, step)
            opt.step()
            plain.step()
        assert all(r.checksum is not None for r in opt.swapper.records(opt.pipeline.name(params[0])).values())
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


class _CtrlCOnce(torch.optim.Adam):
    """Adam that receives a Ctrl-C as its first step call (the first chunk) begins."""

    fired = False
    deepoffload_per_parameter = True  # its step reads each parameter alone

    def step(self, closure=None):
        if not _CtrlCOnce.fired:
            _CtrlCOnce.fired = True
            signal.raise_signal(signal.SIGINT)
        return super().step(closure)


def test_ctrl_c_during_a_step_is_raised_once_every_parameter_stepped(config):
    """A Ctrl-C inside ``step()`` (the wrapped optimizer's own step included) is held back until the whole step is
    done: every parameter and its state stepped, then KeyboardInterrupt; later steps equal the plain optimizer's."""
    _CtrlCOnce.fired = False
    params = make_params(6)
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = OffloadedOptimizer(_CtrlCOnce, params, config, lr=0.01)
    plain = torch.optim.Adam(plain_params, lr=0.01)
    for step in range(3):
        set_grads(plain_params, step), set_grads(params, step)
        plain.step()
        if step == 0:
            with pytest.raises(KeyboardInterrupt):
                opt.step()
            assert _CtrlCOnce.fired
        else:
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(params, plain_params)), step  # no step left half done
        opt.zero_grad()
    opt.close()


def test_ctrl_c_during_step_in_backward_leaves_each_chunk_stepped_or_untouched(config):
    """With ``step_in_backward()`` a Ctrl-C in a chunk's step is raised once that chunk is done (it ends the backward
    there, as a Ctrl-C in any backward does): each parameter is stepped with its gradient or untouched, never half,
    and training goes on."""
    params = make_params(6)
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = OffloadedOptimizer(_CtrlCOnce, params, config, lr=0.01)
    opt.step_in_backward()
    plain = torch.optim.Adam(plain_params, lr=0.01)
    _CtrlCOnce.fired = True  # the first step with step_in_backward checks the loop: it steps in step()
    for q in (params, plain_params):
        sum((p * p).sum() for p in q).backward()
    opt.step(), plain.step()
    opt.zero_grad(), plain.zero_grad()
    before = [p.detach().clone() for p in params]
    _CtrlCOnce.fired = False
    set_grads(plain_params, 0)
    plain.step()
    with pytest.raises(KeyboardInterrupt):
        sum((p * q.grad).sum() for p, q in zip(params, plain_params)).backward()
    chunk = opt._backward.chunks[0]
    for i, p in enumerate(params):
        stepped = any(p is c for c in chunk)
        assert torch.equal(p, plain_params[i] if stepped else before[i]), i
    opt.step()  # steps the parameters whose gradients the interrupted backward left; the others stay as before
    opt.zero_grad()
    sum((p * p).sum() for p in params).backward()
    opt.step()
    opt.close()
