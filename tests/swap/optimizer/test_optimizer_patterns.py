"""OffloadedOptimizer in the patterns users write around an optimizer, each compared with the same optimizer kept in
memory: resetting state (the whole mapping, one entry, clearing it), setting a state tensor by hand, state holding
meta tensors or sharing memory, a forked child that exits normally, an optimizer dropped without close, and a
construction that fails part way."""

from __future__ import annotations

import atexit
import collections
import functools
import gc
import os
from pathlib import Path

import pytest
import torch

import deepoffload.io.handle as handle_module
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer

ADAMW = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1)


@pytest.fixture
def config(scratch):
    return SwapConfig(folder=str(scratch), chunk_bytes=4096, buffer_count=3)  # several chunks per step


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def train(model, optimizer, steps: int, start: int = 0, between=None) -> None:
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        if between is not None:
            between(step, model, optimizer)


def assert_same(reference, model) -> None:
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def assert_same_state(expected: dict, actual: dict) -> None:
    assert expected["param_groups"] == actual["param_groups"]
    assert expected["state"].keys() == actual["state"].keys()
    for index, values in expected["state"].items():
        assert values.keys() == actual["state"][index].keys(), index
        for key, value in values.items():
            assert torch.equal(value, actual["state"][index][key]), (index, key)


def _new_mapping(model, opt):
    opt.state = collections.defaultdict(dict)


def _clear_mapping(model, opt):
    opt.state.clear()


def _delete_entry(model, opt):
    del opt.state[model[0].weight]


def _replace_entry(model, opt):
    opt.state[model[0].weight] = {}


def _clear_entry(model, opt):
    opt.state[model[0].weight].clear()


RESETS = {
    "new mapping": _new_mapping,
    "mapping cleared": _clear_mapping,
    "entry deleted": _delete_entry,
    "entry replaced": _replace_entry,
    "entry cleared": _clear_entry,
}


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "step_in_backward"])
@pytest.mark.parametrize("reset", RESETS)
def test_resetting_state_restarts_it_as_in_memory(reset, in_backward, config):
    """Before: the state stored on disk was read back over the reset one, so the reset was silently ignored."""

    def between(step, model, opt):
        if step == 2:
            RESETS[reset](model, opt)

    reference = make_model()
    plain = ADAMW(reference.parameters())
    train(reference, plain, 3, between=between)
    model = make_model()
    with OffloadedOptimizer(ADAMW, model.parameters(), config) as opt:
        opt.step_in_backward(in_backward)
        train(model, opt, 3, between=between)
        assert_same_state(plain.state_dict(), opt.state_dict())  # the reset state is not in the checkpoint either
        train(reference, plain, 3, start=3)
        train(model, opt, 3, start=3)
        assert_same(reference, model)
        assert_same_state(plain.state_dict(), opt.state_dict())


def test_a_state_tensor_set_by_hand_is_used_not_the_stored_one(config):
    """Before: the stored exp_avg was read back over the one set by hand."""

    def between(step, model, opt):
        if step == 1:
            opt.state[model[0].weight]["exp_avg"] = torch.full_like(model[0].weight, 0.5)

    reference = make_model()
    plain = ADAMW(reference.parameters())
    model = make_model()
    with OffloadedOptimizer(ADAMW, model.parameters(), config) as opt:
        train(reference, plain, 2, between=between)
        train(model, opt, 2, between=between)
        with pytest.raises(KeyError):  # on storage between steps, not silently stale
            opt.state[model[2].weight]["exp_avg"]
        assert_same_state(plain.state_dict(), opt.state_dict())
        train(reference, plain, 3, start=2)
        train(model, opt, 3, start=2)
        assert_same(reference, model)
        assert_same_state(plain.state_dict(), opt.state_dict())


class _MetaNote(torch.optim.Optimizer):
    """SGD that also keeps a tensor on ``meta`` (a shape note, no data) and a step count in its state."""

    deepoffload_per_parameter = True  # its step reads each parameter alone

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["shape"] = torch.empty(p.shape, device="meta")
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(0.9).add_(p.grad)
                p.add_(state["momentum"], alpha=-group["lr"])


def test_state_on_meta_stays_in_memory_and_the_rest_is_stored(config):
    """Before: NotImplementedError 'Cannot copy out of meta tensor' from inside the step."""
    reference = make_model()
    plain = _MetaNote(reference.parameters())
    train(reference, plain, 3)
    model = make_model()
    with OffloadedOptimizer(_MetaNote, model.parameters(), config) as opt:
        train(model, opt, 3)
        assert_same(reference, model)
        assert opt.stored_bytes() > 0
        assert all(set(values) == {"shape"} and values["shape"].is_meta for values in opt.state.values())
        saved = opt.state_dict()
        assert saved["state"][0]["shape"].is_meta and torch.equal(
            saved["state"][0]["momentum"], plain.state_dict()["state"][0]["momentum"]
        )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_exiting_normally_leaves_the_parents_swap_files(config):
    """Before: the child's exit handler removed the parent's run folder; the parent's next step raised ENOENT."""
    model = make_model()
    with OffloadedOptimizer(ADAMW, model.parameters(), config) as opt:
        train(model, opt, 2)
        pid = os.fork()
        if pid == 0:  # the child runs the exit handlers, as after sys.exit() or at the end of a script
            code = 0
            try:
                atexit._run_exitfuncs()
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.isdir(opt.swapper.folder)
        train(model, opt, 2, start=2)
    reference = make_model()
    train(reference, ADAMW(reference.parameters()), 4)
    assert_same(reference, model)


@pytest.mark.parametrize("keep_files", [False, True])
def test_an_optimizer_dropped_without_close_removes_its_files_unless_kept(keep_files, config):
    """Before: its swap folder stayed until the interpreter exited (a loop making optimizers filled the disk)."""
    model = make_model()
    opt = OffloadedOptimizer(ADAMW, model.parameters(), config.replace(keep_files=keep_files))
    train(model, opt, 2)
    folder = opt.swapper.folder
    assert os.listdir(folder)
    del opt
    gc.collect()
    assert os.path.isdir(folder) == keep_files


class _SharedCount(torch.optim.Optimizer):
    """Momentum SGD whose step size shrinks with a count that every parameter's state shares (one tensor, also held
    by the optimizer), and whose two momenta are views of one tensor in the state."""

    deepoffload_per_parameter = True  # its step reads each parameter alone

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})
        self.count = torch.zeros(())

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["count"] = self.count
                    state["both"] = torch.zeros(2, *p.shape)
                    state["fast"], state["slow"] = state["both"][0], state["both"][1]
                state["count"].add_(1)
                state["fast"].mul_(0.5).add_(p.grad)
                state["slow"].mul_(0.9).add_(p.grad)
                p.sub_(state["both"].sum(0) * (group["lr"] / state["count"].item()))


def test_state_tensors_sharing_memory_keep_sharing_it(config):
    """Before: each parameter stored its own copy of the shared count, and the two views were stored apart from the
    tensor they view, so neither sharing survived a step: the parameters silently differed."""
    reference = make_model()
    plain = _SharedCount(reference.parameters())
    train(reference, plain, 4)
    model = make_model()
    with OffloadedOptimizer(_SharedCount, model.parameters(), config) as opt:
        train(model, opt, 4)
        assert_same(reference, model)
        assert opt.optimizer.count.item() == plain.count.item() == 4 * len(list(model.parameters()))


def test_a_failed_construction_gives_the_state_back_and_the_optimizer_can_be_wrapped_again(config, monkeypatch):
    """Adagrad makes its state in __init__, stored when wrapped. Before: a write failing there (a full disk) left the
    Adagrad marked wrapped, so wrapping it again (after freeing space) raised 'already wrapped ... use that wrapper'
    though no wrapper existed, and the state of the chunks already stored was gone from it."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(6)]  # 1 KiB of state each: several chunks
    inner = torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.25)
    expected = {i: {k: v.clone() for k, v in values.items()} for i, values in inner.state_dict()["state"].items()}
    real_write, calls = handle_module.AsyncIOHandle.write_async, []

    def second_fails(self, tensor, file, *args, **kwargs):
        calls.append(file)
        return real_write(self, tensor, "/nonexistent-folder/x.swp" if len(calls) == 2 else file, *args, **kwargs)

    monkeypatch.setattr(handle_module.AsyncIOHandle, "write_async", second_fails)
    with pytest.raises(OSError, match="nonexistent-folder"):
        OffloadedOptimizer(inner, config=config)
    monkeypatch.undo()
    assert len(calls) >= 3  # chunks before and after the failed one were stored
    assert inner.state_dict()["state"].keys() == expected.keys()
    for index, values in inner.state_dict()["state"].items():
        assert all(torch.equal(values[key], expected[index][key]) for key in expected[index]), index
    assert list(Path(config.folder).glob("deepoffload-rank*")) == []  # its swap folder was removed
    with OffloadedOptimizer(inner, config=config) as opt:
        assert opt.stored_bytes() > 0
        saved = opt.state_dict()["state"]
        assert all(torch.equal(saved[i][k], expected[i][k]) for i in expected for k in expected[i])


@pytest.mark.parametrize("reset", RESETS)
def test_a_reset_between_backward_and_step_with_step_in_backward_raises(reset, config):
    """Parameters step inside backward, so a reset made after it came too late for this step. Before: step()
    returned as if the reset had applied to it."""
    model = make_model()
    with OffloadedOptimizer(ADAMW, model.parameters(), config) as opt:
        opt.step_in_backward()
        train(model, opt, 2)
        x, y = torch.ones(6, 8), torch.zeros(6, 4)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        RESETS[reset](model, opt)
        with pytest.raises(RuntimeError, match="was reset"):
            opt.step()
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()  # the reset applies from this step on
        assert opt.state_dict()["state"][0]["step"].item() == 1
