"""Code that reads or writes a streamed model's parameters one by one (the idioms users write around
``model.parameters()``): each gives the in-memory model's answer or raises at once, naming the pattern and what to
use instead; none silently sees the 0-element placeholders."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from deepoffload import StreamOptions, TrainOptions
from deepoffload.errors import StreamedParameterError
from deepoffload.swap.params import StreamedParameter, offload_parameters
from tests.support.stepping import offload_step, reference_step
from tests.swap.params.test_params_patterns import adam, batches, pair, states_equal, train


@pytest.fixture
def streamed(scratch):
    """A trained streamed model (one step), its in-memory reference after the same step, and the offload."""
    reference, model = pair()
    optimizer = adam(reference.parameters())
    offload = offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam))
    x = batches(1)[0]
    train(model, offload_step(offload), x), train(reference, reference_step(optimizer), x)
    yield reference, model, offload
    offload.close()


@pytest.mark.parametrize(
    "idiom",
    [
        lambda m: {n: p.detach().clone() for n, p in m.named_parameters()},
        lambda m: torch.save({n: p for n, p in m.named_parameters()}, io.BytesIO()),
        lambda m: [p.data for p in m.parameters()],
        lambda m: [p.clone() for p in m.parameters()],
        lambda m: torch.nn.utils.parameters_to_vector(m.parameters()),
        lambda m: [p.sum().item() for p in m.parameters()],
    ],
    ids=["detach-clone", "torch-save", "data", "clone", "parameters_to_vector", "sum"],
)
def test_reading_parameters_one_by_one_is_refused(streamed, idiom):
    _, model, _ = streamed
    with pytest.raises(StreamedParameterError, match=r"blocks\.0\..* is streamed.*model\.state_dict\(\)|p\.data"):
        idiom(model)


def test_state_dict_is_the_way_to_copy_and_save(streamed, tmp_path):
    reference, model, _ = streamed
    torch.save(model.state_dict(), tmp_path / "w.pt")
    assert states_equal(torch.load(tmp_path / "w.pt"), reference.state_dict())


def test_parameter_counts_and_shapes_are_the_stored_ones(streamed):
    reference, model, _ = streamed
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == sum(
        p.numel() for p in reference.parameters()
    )
    for p, r in zip(model.parameters(), reference.parameters()):
        assert (p.shape, p.size(), p.size(-1), p.dim(), p.ndim, p.nelement(), p.dtype, p.device) == (
            r.shape,
            r.size(),
            r.size(-1),
            r.dim(),
            r.ndim,
            r.nelement(),
            r.dtype,
            r.device,
        )
    assert "StreamedParameter" in repr(model.blocks[0].linear.weight)  # printing does not raise


def test_an_optimizer_built_after_offloading_is_refused(streamed):
    _, model, _ = streamed
    with pytest.raises(StreamedParameterError, match="optimizer=<factory>"):
        torch.optim.AdamW(model.parameters())
    rest = [p for p in model.parameters() if not isinstance(p, StreamedParameter)]
    torch.optim.AdamW(rest)  # the parameters outside the blocks are plain


def test_ema_copies_are_refused_and_state_dict_ema_matches(streamed):
    reference, model, _ = streamed
    with pytest.raises(StreamedParameterError, match="copy.deepcopy"):
        copy.deepcopy(model)
    ema = copy.deepcopy(reference)
    with pytest.raises(StreamedParameterError, match="is streamed"), torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)
    # the working form: from state_dict() (real weights, read block by block)
    expected = {k: v.clone() for k, v in reference.state_dict().items()}
    averaged = {k: v.clone() for k, v in reference.state_dict().items()}
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            averaged[key].mul_(0.9).add_(value, alpha=0.1)
            expected[key].mul_(0.9).add_(reference.state_dict()[key], alpha=0.1)
    assert states_equal(averaged, expected)


def test_writes_to_streamed_parameters_are_refused(streamed):
    reference, model, _ = streamed
    with pytest.raises(StreamedParameterError, match="would be lost"):
        nn.init.zeros_(model.blocks[1].linear.weight)
    with pytest.raises(StreamedParameterError, match="would be lost"):
        model.blocks[1].linear.weight.data = torch.zeros(16, 16)
    assert states_equal(model.state_dict(), reference.state_dict())  # nothing changed


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_clip_grad_norm_over_model_parameters_is_refused(scratch, mode):
    """After backward the blocks' gradients are applied (fused) or on storage (grads): torch's clip_grad_norm_
    would see None for them and clip by a wrong norm. Before backward and after step() ``p.grad`` is None, as in
    memory after zero_grad(set_to_none=True)."""
    reference, model = pair()
    optimizer = adam(reference.parameters())
    x = batches(1)[0]
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=adam)) as offload:
        assert all(p.grad is None for p in model.parameters())
        model(x).square().mean().backward()
        with pytest.raises(StreamedParameterError, match="clip_grad_norm_.*off.step"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(StreamedParameterError, match="off.zero_grad"):
            model.blocks.zero_grad()  # (model.zero_grad() too, after clearing the parameters before the blocks)
        offload.step()
        model.zero_grad()  # nothing is held for the blocks any more
        offload.zero_grad()
        assert train(model, offload_step(offload), x) != 0  # training goes on
        train(reference, reference_step(optimizer), x), train(reference, reference_step(optimizer), x)
        assert states_equal(model.state_dict(), reference.state_dict())


def test_parameters_read_while_their_block_runs_are_real(scratch):
    """Inside a block's forward its parameters are in memory: a hook of a submodule reading them gets the real
    values (hooks of the block itself run after it released them, and are refused)."""
    reference, model = pair()
    seen = {}
    model.blocks[1].linear.register_forward_hook(lambda m, i, o: seen.update({"w": m.weight.detach().clone()}))
    with offload_parameters(model, str(scratch)), torch.no_grad():
        model(batches(1)[0])
    assert torch.equal(seen["w"], reference.blocks[1].linear.weight)


def test_close_gives_plain_parameters_back(streamed):
    reference, model, offload = streamed
    offload.close()
    assert not any(isinstance(p, StreamedParameter) for p in model.parameters())
    assert states_equal(
        {n: p.detach().clone() for n, p in model.named_parameters()}, dict(reference.named_parameters())
    )
    copy.deepcopy(model)


def test_parameters_after_close_without_restore_say_so(scratch):
    _, model = pair()
    offload = offload_parameters(model, str(scratch))
    offload.close(restore=False)
    with pytest.raises(StreamedParameterError, match=r"discarded by close\(restore=False\)"):
        model.blocks[0].linear.weight.detach()


def _resident(model: nn.Module) -> list[str]:
    """Names of the block parameters in memory now (plain parameters)."""
    return [n for n, p in model.named_parameters() if n.startswith("blocks.") and type(p) is nn.Parameter]


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_writes_to_a_resident_block_are_written_back(scratch, mode):
    """With prefetch covering every block, blocks stay in memory after a no_grad forward as plain parameters:
    in-place writes to them (torch.no_grad() ops, nn.init, load_state_dict, p.data = ...) reach storage when the
    block is released (after its backward in grads mode; its step writes it in fused mode), so training,
    state_dict() and close() see them as in memory."""
    reference, model = pair()
    optimizer = adam(reference.parameters())
    x = batches(2)
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode=mode, optimizer=adam),
        stream=StreamOptions(prefetch=len(model.blocks)),
    ) as offload:
        with torch.no_grad():
            model(x[0]), reference(x[0])
        resident = _resident(model)
        assert len(resident) > 3  # the test needs resident blocks
        for m in (model, reference):
            params = dict(m.named_parameters())
            with torch.no_grad():
                params[resident[0]].mul_(0.5)
            nn.init.zeros_(params[resident[-1]])
            params[resident[1]].data = torch.ones_like(params[resident[1]])
        partial = {n: torch.full_like(t, 0.25) for n, t in reference.state_dict().items() if n == resident[2]}
        model.load_state_dict(partial, strict=False), reference.load_state_dict(partial, strict=False)
        assert states_equal(model.state_dict(), reference.state_dict())
        for batch in x:
            assert train(model, offload_step(offload), batch) == train(reference, reference_step(optimizer), batch)
        assert states_equal(model.state_dict(), reference.state_dict())
    assert states_equal(dict(model.named_parameters()), dict(reference.named_parameters()))


def test_a_write_to_a_compute_dtype_copy_is_refused_not_dropped(scratch):
    """With compute_dtype a resident parameter is a bfloat16 copy of float32 masters: a write to it cannot be
    stored exactly, so releasing the block raises naming it (the stored values stay), and so does close()."""
    reference, model = pair()
    x = batches(1)[0]
    offload = offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode="grads", optimizer=adam),
        stream=StreamOptions(compute_dtype=torch.bfloat16, prefetch=len(model.blocks)),
    )
    with torch.no_grad():
        model(x)
    params = dict(model.named_parameters())
    name = next(n for n in _resident(model) if params[n].dtype == torch.bfloat16)
    with torch.no_grad():
        params[name].mul_(0.5)
    with pytest.raises(StreamedParameterError, match=rf"parameter {name} was changed in place.*compute copy"):
        model(x).float().square().mean().backward()  # grads mode releases each block after its backward
    stored = {n: t for n, t in model.state_dict().items() if "running" not in n and "batches" not in n}
    assert states_equal(stored, dict(reference.named_parameters()))
    offload.close()

    _, model = pair()
    offload = offload_parameters(
        model, str(scratch / "2"), stream=StreamOptions(compute_dtype=torch.bfloat16, prefetch=len(model.blocks))
    )
    with torch.no_grad():
        model(x)
    nn.init.zeros_(dict(model.named_parameters())[name])
    with pytest.raises(StreamedParameterError, match=rf"parameter {name} was changed in place.*compute copy"):
        offload.close()
    offload.close()
    assert states_equal(dict(model.named_parameters()), dict(reference.named_parameters()))
