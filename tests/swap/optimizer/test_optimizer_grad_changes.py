"""``step_in_backward()`` and gradients changed between backward and ``step()``.

Version counters miss ``.data`` edits, GradScaler's unscale (``torch._amp_foreach_non_finite_check_and_unscale_``) and
``p.grad = other``: each change is refused, before any parameter moves on the first step (which only checks), and a
GradScaler at its first ``scale()``; the alternative each error names (plain ``step()``) equals memory."""

from __future__ import annotations

import gc

import pytest
import torch

from deepoffload import OffloadedOptimizer, SwapConfig
from deepoffload.errors import UnsupportedError
from deepoffload.swap.grad_prints import GradPrint, _sums, _words, digest


@pytest.fixture
def config(scratch):
    return SwapConfig(folder=str(scratch), chunk_bytes=4096, buffer_count=4)  # several chunks per step


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def data(k: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(k))


def _data_mul(model):
    for p in model.parameters():
        p.grad.data.mul_(0.5)


def _reassign(model):
    for p in model.parameters():
        p.grad = p.grad * 0.5


def _unscale(model):  # what GradScaler.unscale_ does to the gradients (no version bump)
    grads = [p.grad for p in model.parameters()]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1), torch.full((1,), 0.5))


def _clip(model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def _zero(model):
    for p in model.parameters():
        p.grad = None


EDITS = {"data_mul": _data_mul, "reassign": _reassign, "unscale": _unscale, "clip": _clip, "zero": _zero}


def test_versions_miss_these_changes_the_print_sees_them():
    grad = torch.randn(5, 3)
    mark = GradPrint(grad)
    version = grad._version
    grad.data.mul_(2)
    assert grad._version == version and mark.changed(grad) == "values changed"
    grad = torch.randn(5, 3)
    mark = GradPrint(grad)
    torch._amp_foreach_non_finite_check_and_unscale_([grad], torch.zeros(1), torch.full((1,), 0.5))
    assert mark.changed(grad) == "values changed"
    assert mark.changed(grad.clone()) == "replaced"
    assert GradPrint(grad).changed(grad) is None
    odd = torch.arange(7, dtype=torch.uint8)  # not a whole number of words
    assert digest(odd) != digest(odd.flip(0))
    assert digest(torch.randn(4, 6).t()) != digest(torch.randn(4, 6).t())


def test_a_dense_gradient_in_another_memory_order_is_digested_in_place():
    """A ``channels_last`` or transposed gradient fills its memory exactly: digested there, without a copy."""
    for grad in (
        torch.randn(4, 6, 3, 5).to(memory_format=torch.channels_last),
        torch.randn(8, 16).t(),
        torch.randn(3, 2, 5).transpose(0, 2),
    ):
        assert not grad.is_contiguous()
        assert _words(grad).data_ptr() == grad.data_ptr() and _words(grad).numel() == grad.numel()
        mark = GradPrint(grad)
        grad.data[(1,) * grad.dim()] += 1.0  # (a version of its own)
        assert mark.changed(grad) == "values changed"
    sliced = torch.randn(6, 8)[:, :4]  # not dense: copied, still digested
    assert _words(sliced).data_ptr() != sliced.data_ptr() and GradPrint(sliced).changed(sliced) is None


@pytest.mark.parametrize("digest_of", [digest, lambda t: _sums(_words(t))], ids=["cpu", "device"])
def test_digests_see_one_changed_element_anywhere(digest_of):
    big = torch.zeros(3 << 20)  # several slices of the device digest
    before = digest_of(big)
    for index in (0, (1 << 20) + 5, -1):
        big[index] = 1e-30
        assert digest_of(big) != before
        big[index] = 0
    assert digest_of(big) == before
    odd = torch.arange(7, dtype=torch.uint8)
    assert digest_of(odd) != digest_of(odd.flip(0))


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_change_is_refused_on_the_first_step_before_any_parameter_moves(config, edit):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with OffloadedOptimizer(torch.optim.Adam, model.parameters(), config, lr=0.1) as opt:
        opt.step_in_backward()
        model(data(0)).square().mean().backward()
        EDITS[edit](model)
        with pytest.raises(UnsupportedError, match="changed between backward and step.*nothing was stepped"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert opt.stored_bytes() == 0


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_change_after_the_checked_step_is_refused(config, edit):
    model = mlp()
    with OffloadedOptimizer(torch.optim.Adam, model.parameters(), config, lr=0.1) as opt:
        opt.step_in_backward()
        for k in range(2):
            model(data(k)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        model(data(2)).square().mean().backward()
        EDITS[edit](model)
        with pytest.raises(UnsupportedError, match="changed between backward and step.*backward stepped took"):
            opt.step()


def _scaled_loop(model, opt, steps=4):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1)
    losses = []
    for k in range(steps):
        loss = model(data(k)).square().mean() * (1e35 if k == 1 else 1.0)  # step 1 overflows: skipped
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append((loss.item(), scaler.get_scale()))
    return losses


def test_a_grad_scaler_is_refused_at_its_first_scale_and_plain_step_is_exact(config):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = OffloadedOptimizer(torch.optim.SGD, model.parameters(), config, lr=0.1)
    opt.step_in_backward()
    with pytest.raises(UnsupportedError, match=r"GradScaler.*step_in_backward\(False\)"):
        _scaled_loop(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.step_in_backward(False)  # the alternative the error names
    reference = mlp()
    expected = _scaled_loop(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    assert _scaled_loop(model, opt) == expected
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    opt.close()
    torch.amp.GradScaler("cpu").scale(torch.ones(()))  # a closed optimizer refuses nothing


def test_an_optimizer_dropped_without_close_neither_steps_nor_refuses_a_scaler_once_collected(config):
    """A parameter's hooks live as long as it does: they must not keep a dropped optimizer stepping in backward."""
    reference, model = mlp(), mlp()
    opt = OffloadedOptimizer(torch.optim.SGD, model.parameters(), config, lr=0.1)
    opt.step_in_backward()
    for m, o in ((reference, torch.optim.SGD(reference.parameters(), lr=0.1)), (model, opt)):
        for k in range(2):
            m(data(k)).square().mean().backward()
            o.step()
            o.zero_grad()
    del opt, o  # e.g. after an error, never closed
    gc.collect()
    for m in (reference, model):  # a second phase with an optimizer of its own, and a GradScaler
        after = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for k in range(2, 4):
            scaler.scale(m(data(k)).square().mean()).backward()
            scaler.step(after)
            scaler.update()
            after.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


def test_a_grad_scaler_over_another_model_is_not_refused_while_an_optimizer_steps_in_backward(config):
    """The refusal asks whether the scaled loss reaches the optimizer's parameters: another model's loop (in memory,
    beside it or after it with the optimizer dropped but not yet collected) trains as it would alone."""
    model = mlp()
    opt = OffloadedOptimizer(torch.optim.SGD, model.parameters(), config, lr=0.1)
    opt.step_in_backward()
    gc.disable()  # the dropped optimizer below stays uncollected, as between two cycle collections
    try:
        other, alone = mlp(), mlp()
        expected = _scaled_loop(alone, torch.optim.SGD(alone.parameters(), lr=0.1))
        assert _scaled_loop(other, torch.optim.SGD(other.parameters(), lr=0.1)) == expected
        with pytest.raises(UnsupportedError, match="GradScaler"):  # its own loss still is refused
            _scaled_loop(model, opt)
        model(data(0)).sum().backward()  # (refused before backward: a backward now is its first)
        opt.step()
        opt.zero_grad()
        del opt
        again, alone = mlp(), mlp()
        expected = _scaled_loop(alone, torch.optim.SGD(alone.parameters(), lr=0.1))
        assert _scaled_loop(again, torch.optim.SGD(again.parameters(), lr=0.1)) == expected
    finally:
        gc.enable()
        gc.collect()


def test_a_grad_scaler_subclass_with_its_own_scale_is_refused_too(config):
    """torch's ``ShardedGradScaler`` (FSDP) overrides ``scale``, and so may a scaler defined after the optimizer."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = mlp()
    with OffloadedOptimizer(torch.optim.SGD, model.parameters(), config, lr=0.1) as opt:
        opt.step_in_backward()

        class DoublingScaler(torch.amp.GradScaler):
            def scale(self, outputs):
                return outputs * 2.0

        for scaler in (ShardedGradScaler("cpu"), DoublingScaler("cpu")):
            with pytest.raises(UnsupportedError, match=r"GradScaler.*step_in_backward\(False\)"):
                scaler.scale(model(data(0)).square().mean())
            torch.amp.GradScaler("cpu", enabled=False).scale(torch.ones(()))  # a disabled one is not refused
            type(scaler)("cpu", enabled=False).scale(torch.ones(()))
    ShardedGradScaler("cpu").scale(torch.ones(()))  # nor any once the optimizer is closed


def _warmup_loop(model, opt, steps=4, start=0):
    """Sets the learning rate after backward, before ``step()`` (a warm-up written that way)."""
    losses = []
    for k in range(start, start + steps):
        loss = model(data(k)).square().mean()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = 0.01 * (k + 2)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_setting_changed_between_backward_and_step_is_refused(config):
    """Backward steps with the param groups' settings as they are then: a later change would apply a step late."""
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01) as opt:
        opt.step_in_backward()
        with pytest.raises(UnsupportedError, match="'lr' of param group 0 changed.*nothing was stepped"):
            _warmup_loop(model, opt)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        opt.zero_grad()
        opt.param_groups[0]["lr"] = 0.01
        model(data(0)).square().mean().backward()
        opt.step()  # the check step passes
        opt.zero_grad()
        model(data(0)).square().mean().backward()  # (stepped in backward)
        opt.param_groups[0]["weight_decay"] = 0.5
        with pytest.raises(UnsupportedError, match="'weight_decay' of param group 0.*backward stepped with"):
            opt.step()
    model = mlp()
    with OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01) as opt:  # the advice
        opt.step_in_backward(False)
        reference = mlp()
        expected = _warmup_loop(reference, torch.optim.AdamW(reference.parameters(), lr=0.01))
        assert _warmup_loop(model, opt) == expected
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


@pytest.mark.parametrize("lr", [0.01, torch.tensor(0.01)])
def test_a_scheduler_stepped_after_step_is_exact_in_backward(config, lr):
    def loop(model, opt):
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8)
        for k in range(5):
            model(data(k)).square().mean().backward()
            opt.step()
            scheduler.step()  # changes lr (a tensor lr in place) before the next backward
            opt.zero_grad()

    reference, model = mlp(), mlp()
    loop(reference, torch.optim.AdamW(reference.parameters(), lr=lr))
    with OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=lr) as opt:
        opt.step_in_backward()
        loop(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


def _clamping_loop(model, opt, steps=3):
    """Clamps the parameters between backward and ``step()``."""
    losses = []
    for k in range(steps):
        loss = model(data(k)).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.2, 0.2)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_parameter_changed_between_backward_and_step_is_refused(config):
    """Backward steps the parameters: an edit before ``step()`` would come after that step instead of before it."""
    model = mlp()
    with OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01) as opt:
        opt.step_in_backward()
        with pytest.raises(UnsupportedError, match="4 parameter.*changed in place.*nothing was stepped"):
            _clamping_loop(model, opt)
        opt.zero_grad()
        model(data(0)).square().mean().backward()
        opt.step()  # the check step passes
        opt.zero_grad()
        model(data(1)).square().mean().backward()  # (stepped in backward)
        with torch.no_grad():
            model[0].weight.copy_(model[0].weight * 0.5)
        with pytest.raises(UnsupportedError, match="1 parameter.*backward stepped them before"):
            opt.step()
    model, reference = mlp(), mlp()
    with OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01) as opt:  # the advice
        expected = _clamping_loop(reference, torch.optim.AdamW(reference.parameters(), lr=0.01))
        assert _clamping_loop(model, opt) == expected
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


def _accumulating_loop(model, opt, steps=2, start=0):
    """Two backwards per ``step()``."""
    for k in range(start, start + steps):
        for j in range(2):
            (model(data(2 * k + j)).square().mean() / 2).backward()
        opt.step()
        opt.zero_grad()


def test_gradient_accumulation_is_refused_saying_what_was_stepped_and_its_alternative_is_exact(config):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01) as opt:
        opt.step_in_backward()
        with pytest.raises(UnsupportedError, match="second backward.*nothing was stepped"):
            _accumulating_loop(model, opt)  # on the check step
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        opt.step_in_backward(False)  # starting over, as the message says
        opt.zero_grad()
        opt.step_in_backward()
        model(data(0)).square().mean().backward()
        opt.step()  # the check step passes
        opt.zero_grad()
        with pytest.raises(UnsupportedError, match="second backward.*already stepped 4 parameter"):
            _accumulating_loop(model, opt)  # accumulation starting later: backward stepped the first's gradients
        with pytest.raises(UnsupportedError, match="changed between backward and step"):
            opt.step()  # (it would step those parameters twice)
    model, reference = mlp(), mlp()
    with OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01) as opt:  # the advice
        _accumulating_loop(reference, torch.optim.AdamW(reference.parameters(), lr=0.01))
        _accumulating_loop(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


def test_a_grad_scaler_under_bf16_autocast_with_plain_step_equals_memory(config):
    """``torch.amp.GradScaler("cpu")`` with bf16 autocast, unscale_, clip and an overflowing step, in many chunks."""

    def loop(model, opt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _scaled_loop(model, opt)

    reference, model = mlp(), mlp()
    expected = loop(reference, torch.optim.AdamW(reference.parameters(), lr=0.01))
    with OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01) as opt:
        assert loop(model, opt) == expected
        assert opt.stored_bytes() > 0
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
