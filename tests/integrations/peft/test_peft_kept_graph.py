"""``StreamOptions(recompute=False)``: LoRA over a served (frozen) base keeps each block's forward graph for its
backward, which reads the block again but does not recompute its forward; training stays bit-identical to in-memory
PEFT."""

from __future__ import annotations

import pytest
import torch

import deepoffload
from deepoffload import LoadOptions, StreamOptions, TrainOptions
from tests.integrations.peft import served as s

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _served(folder, swap, mode, recompute):
    import peft

    model, off = deepoffload.from_pretrained(
        folder,
        path=swap,
        train=TrainOptions(s.adam, mode=mode),
        load=LoadOptions(serve_from_checkpoint=True),
        stream=StreamOptions(recompute=recompute),
    )
    torch.manual_seed(1)
    return peft.get_peft_model(model, s.lora_config()), off


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_kept_graphs_train_lora_over_a_served_base_bit_identical_without_recomputing(tmp_path, monkeypatch, mode):
    folder = s.save_base(tmp_path / "base", hidden=64)
    reference = s.in_memory(folder)
    optimizer = s.adam([p for p in reference.parameters() if p.requires_grad])
    expected = s.plain_loop(reference, optimizer.step, optimizer.zero_grad)

    from transformers.models.llama import modeling_llama

    calls = []
    forward = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: calls.append(1) or forward(self, x))
    model, off = _served(folder, tmp_path / "swap", mode, recompute=False)
    with off:
        losses = s.plain_loop(model, off.step, off.zero_grad)
        assert losses == expected
        s.assert_adapters_equal(model, reference)
        assert all(block.served for block in off.blocks)
        assert s.folder_bytes(tmp_path / "swap") < s.folder_bytes(folder) / 10
    # one forward per block and step (2 blocks, 3 steps): none recomputed in backward (the default recomputes: 12)
    assert len(calls) == 2 * s.STEPS
