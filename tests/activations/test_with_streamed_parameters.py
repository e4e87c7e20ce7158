"""``offload_activations`` around streamed training (``offload_parameters``): the block inputs kept for recompute go
to storage too, and the parameters after several steps are bit-identical to in-memory training without either; in
both gradient modes, with the backward inside the context and after it."""

from __future__ import annotations

import pytest
import torch

from deepoffload import TrainOptions, offload_activations
from deepoffload.swap.params import offload_parameters
from tests.support.models import ModelSize, SyntheticText, build_model

from .helpers import config

SIZE = ModelSize(vocab=64, width=64, layers=3, heads=2, context=64, batch=8)


@pytest.mark.parametrize("backward", ["inside", "after"])
@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_streamed_training_with_saved_activations_on_storage(scratch, mode, backward):
    reference, model = build_model(SIZE), build_model(SIZE)
    make = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    optimizer = make(reference.parameters())
    data = SyntheticText(SIZE)
    (scratch / "params").mkdir()
    offload = offload_parameters(model, str(scratch / "params"), train=TrainOptions(make, mode=mode))
    written = 0
    try:
        for _ in range(3):
            batch = data.batch()
            loss = reference.loss(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with offload_activations(str(scratch), min_bytes=0, config=config()) as off:
                streamed = model.loss(batch)
                if backward == "inside":
                    streamed.backward()
            if backward == "after":
                streamed.backward()
            offload.step()
            offload.zero_grad()
            assert streamed.item() == loss.item()
            written += off.stats()["written"]
            del streamed
    finally:
        offload.close(restore=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert written >= 3 * SIZE.layers, "each streamed block's saved input went to storage"
