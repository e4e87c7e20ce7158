"""Parameter offload, clipping by the global gradient norm (grads mode): ``step(clip_grad_norm=...)`` returns the same
total norm as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` and training stays bit-identical to the
in-memory reference, whether clipping bites or not, with gradient accumulation, prefetch 0 and 1, other norm orders,
mixed dtypes; fused mode and bad arguments raise clear errors. ``grad_norm`` alone: split arbitrarily, it gives
torch's results."""

from __future__ import annotations

import math

import pytest
import torch

from deepoffload import StreamOptions, TrainOptions
from deepoffload.swap import grad_norm
from deepoffload.swap.params import offload_parameters
from tests.support.models import ModelSize, SyntheticText, build_model

SIZE = ModelSize(vocab=64, width=32, layers=4, heads=2, context=16, batch=3)
BITES, NEVER = 0.05, 1e6  # max_norm: below every step's gradient norm here / far above it


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


@pytest.mark.parametrize("max_norm", [BITES, NEVER], ids=["clipping", "not-clipping"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_clipped_training_bit_identical_to_in_memory(scratch, prefetch, max_norm):
    reference, model = build_model(SIZE), build_model(SIZE)
    optimizer = adam(reference.parameters())
    data = SyntheticText(SIZE)
    with offload_parameters(
        model, str(scratch), train=TrainOptions(mode="grads", optimizer=adam), stream=StreamOptions(prefetch=prefetch)
    ) as offload:
        for _ in range(3):
            optimizer.zero_grad()
            for _ in range(2):  # two micro-batches per step: the stored gradients accumulate
                batch = data.batch()
                loss = reference.loss(batch)
                loss.backward()
                streamed = model.loss(batch)
                streamed.backward()
                assert streamed.item() == loss.item()
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            optimizer.step()
            total = offload.step(clip_grad_norm=max_norm)
            offload.zero_grad()
            assert torch.equal(total, expected)
            assert (total.item() > max_norm) == (max_norm == BITES)  # clipping really happens, or really not
        state = offload.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


@pytest.mark.parametrize("norm_type", [1.0, math.inf])
def test_other_norm_orders(scratch, norm_type):
    reference, model = build_model(SIZE), build_model(SIZE)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    data = SyntheticText(SIZE)
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    with offload_parameters(model, str(scratch), train=TrainOptions(mode="grads", optimizer=make)) as offload:
        for _ in range(2):
            batch = data.batch()
            optimizer.zero_grad()
            reference.loss(batch).backward()
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type)
            optimizer.step()
            model.loss(batch).backward()
            total = offload.step(clip_grad_norm=0.01, norm_type=norm_type)
            offload.zero_grad()
            assert torch.equal(total, expected) and total.item() > 0.01
        state = offload.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_frozen_block_parameters_are_left_out_of_the_norm(scratch):
    """Parameters without gradients count for nothing, as in torch; a block may be partly frozen."""
    reference, model = build_model(SIZE), build_model(SIZE)
    for m in (reference, model):
        m.blocks.layers[1].linear1.weight.requires_grad_(False)
    optimizer = adam([p for p in reference.parameters() if p.requires_grad])
    batch = SyntheticText(SIZE).batch()
    with offload_parameters(model, str(scratch), train=TrainOptions(mode="grads", optimizer=adam)) as offload:
        reference.loss(batch).backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), BITES)
        optimizer.step()
        model.loss(batch).backward()
        assert torch.equal(offload.step(clip_grad_norm=BITES), expected)
        state = offload.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_fused_mode_refuses_to_clip(scratch):
    model = build_model(SIZE)
    with offload_parameters(model, str(scratch), train=TrainOptions(mode="fused", optimizer=adam)) as offload:
        model.loss(SyntheticText(SIZE).batch()).backward()
        head = model.head.weight.detach().clone()
        with pytest.raises(ValueError, match='impossible in fused mode.*mode="grads"'):
            offload.step(clip_grad_norm=1.0)
        assert torch.equal(model.head.weight, head)  # nothing stepped
        assert offload.step() is None  # without clipping the step goes on


@pytest.mark.parametrize(
    "max_norm, norm_type, match",
    [
        (-1.0, 2.0, "clip_grad_norm=-1.0"),
        (math.nan, 2.0, "clip_grad_norm=nan"),
        ("1", 2.0, "clip_grad_norm='1'"),
        (True, 2.0, "clip_grad_norm=True"),
        (1.0, "2", "norm_type='2'"),
        (1.0, math.nan, "norm_type=nan"),
    ],
)
def test_bad_clip_arguments(scratch, max_norm, norm_type, match):
    model = build_model(SIZE)
    with offload_parameters(model, str(scratch), train=TrainOptions(mode="grads", optimizer=adam)) as offload:
        with pytest.raises(ValueError, match=match):
            offload.step(clip_grad_norm=max_norm, norm_type=norm_type)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_grad_norm_split_anywhere_matches_torch(norm_type):
    """Mixed dtypes (torch groups them, not in first-seen order), norms taken in three arbitrary pieces."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 7), (3,), (11,), (4, 4), (2,), (6, 3)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float64, torch.float32]
    grads = [torch.randn(s, generator=generator).to(d) for s, d in zip(shapes, dtypes)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type)
    norms = (
        grad_norm.tensor_norms(grads[:1], norm_type)
        + grad_norm.tensor_norms(grads[1:4], norm_type)
        + grad_norm.tensor_norms(grads[4:], norm_type)
    )
    total = grad_norm.total_norm(norms, norm_type)
    coefficient = grad_norm.clip_coefficient(0.5, total)
    grad_norm.scale_(grads[:2], coefficient)
    grad_norm.scale_(grads[2:], coefficient)
    assert torch.equal(total, expected) and coefficient.item() < 1
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, params))
    assert torch.equal(grad_norm.total_norm([], norm_type), torch.tensor(0.0))
