"""LoRA over a base served from its Hugging Face folder: ``peft.get_peft_model`` on ``deepoffload.from_pretrained``'s
model trains bit-identical to the same PEFT run on transformers' in-memory ``from_pretrained``, and the base is never
copied to the swap folder."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.peft import served as s

pytest.importorskip("peft")
pytest.importorskip("transformers")


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_lora_over_a_served_base_trains_bit_identical_to_in_memory_peft(tmp_path, mode):
    folder = s.save_base(tmp_path / "base", hidden=64)
    reference = s.in_memory(folder)
    optimizer = s.adam([p for p in reference.parameters() if p.requires_grad])
    expected = s.plain_loop(reference, optimizer.step, optimizer.zero_grad)

    model, off = s.served(folder, tmp_path / "swap", mode)
    with off:
        losses = s.plain_loop(model, off.step, off.zero_grad)
        assert losses == expected
        s.assert_adapters_equal(model, reference)
        # the whole state dict under PEFT's names, the wrapped base weights read from the checkpoint (it held
        # 0-element placeholders under "base_layer" names before the block's state_dict hook followed the move)
        state, expected_state = model.state_dict(), reference.state_dict()
        assert state.keys() == expected_state.keys()
        assert all(torch.equal(state[k], v) for k, v in expected_state.items())
        # the base is read from the folder's own file, never written to the swap folder (only the adapters' state)
        base = s.folder_bytes(folder)
        assert s.folder_bytes(tmp_path / "swap") < base / 10
        assert all(block.served for block in off.blocks)
