"""A ``GradScaler`` (no autocast) over a streamed model with ``compute_dtype=torch.bfloat16``.

The blocks' gradients never reach the scaler (fused mode steps them inside backward, grads mode keeps them for
``off.step()``): it stepped on the scaled gradients (a weight moved by about 1e12 where memory moves it by 1e-3) and
took steps it should have skipped. Fused mode is now refused at the first ``scaler.scale()``, before that backward;
grads mode, which the error names, unscales and checks the stored gradients in ``scaler.step`` and equals the same
loop with the scaler in memory (and so does dropping the scaler: bf16 needs none)."""

from __future__ import annotations

import pytest
import torch

from deepoffload import StreamOptions, TrainOptions
from deepoffload.errors import StreamedParameterError
from deepoffload.swap.params import StreamedOptimizer, offload_parameters

harness = pytest.importorskip("tests.support.matrix_harness")


def _loop(model, optimizer, scaler=None, steps=3):
    losses = []
    for k in range(steps):
        torch.manual_seed(100 + k)
        loss = harness.loss_of(model(**harness.batch("plain", k)))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("scaled", [True, False])
def test_a_grad_scaler_is_refused_in_fused_mode_and_grads_mode_is_exact(scratch, scaled):
    model = harness.build("plain").train()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}  # (the forward moves BatchNorm's stats)
    fused = offload_parameters(
        model,
        str(scratch / "fused"),
        train=TrainOptions(mode="fused", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)),
        stream=StreamOptions(compute_dtype=torch.bfloat16),
    )
    with pytest.raises(StreamedParameterError, match='GradScaler.*nothing was stepped.*mode="grads"'):
        _loop(model, StreamedOptimizer(fused), torch.amp.GradScaler("cpu"))
    after = fused.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "refused before any parameter moved"
    fused.close(restore=False)
    model = harness.build("plain").train()
    off = offload_parameters(
        model,
        str(scratch / "grads"),
        train=TrainOptions(mode="grads", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)),
        stream=StreamOptions(compute_dtype=torch.bfloat16),
    )
    opt = StreamedOptimizer(off)
    losses = _loop(model, opt, torch.amp.GradScaler("cpu") if scaled else None)  # what the error names
    reference = harness._compute_bf16_in_memory(harness.build("plain").train())
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    expected = _loop(reference, torch.optim.SGD(reference.parameters(), lr=0.1), scaler)
    assert losses == expected
    got = off.state_dict()
    assert all(torch.equal(v, got[k]) for k, v in reference.state_dict().items())
    off.close()
    torch.amp.GradScaler("cpu").scale(torch.ones(()))  # a closed offload refuses nothing


def test_a_grad_scaler_over_another_model_is_not_refused_while_blocks_train(scratch):
    """Only a scaled loss that runs the offload's blocks (or reaches its model's parameters) is refused (fused
    mode): a model in memory beside a streamed one trains with its GradScaler as it would alone."""
    model = harness.build("plain").train()
    train = TrainOptions(lambda ps: torch.optim.SGD(ps, lr=0.1), mode="fused")
    off = offload_parameters(model, str(scratch), train=train)
    try:
        other, alone = harness.build("plain").train(), harness.build("plain").train()
        expected = _loop(alone, torch.optim.SGD(alone.parameters(), lr=0.1), torch.amp.GradScaler("cpu"))
        got = _loop(other, torch.optim.SGD(other.parameters(), lr=0.1), torch.amp.GradScaler("cpu"))
        assert got == expected
        assert all(torch.equal(a, b) for a, b in zip(alone.parameters(), other.parameters()))
        with pytest.raises(StreamedParameterError, match="GradScaler"):
            _loop(model, StreamedOptimizer(off), torch.amp.GradScaler("cpu"))
    finally:
        off.close()
