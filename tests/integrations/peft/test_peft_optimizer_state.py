"""Where the adapters of a LoRA run over a served base live: their values and gradients in memory, their optimizer
state on storage (the rest's ``OffloadedOptimizer``: nothing of it in memory between steps), and that state, read
back, is bit for bit the state of the same PEFT run's ``torch.optim.AdamW`` in memory."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.peft import served as s

pytest.importorskip("peft")
pytest.importorskip("transformers")


def _state_by_name(optimizer, names: dict[int, str]) -> dict[str, dict]:
    """The optimizer's ``state_dict()`` state keyed by parameter name (its indices follow ``param_groups``)."""
    saved = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in saved["param_groups"] for i in group["params"]]
    return {names[id(p)]: saved["state"][i] for p, i in zip(params, indices) if i in saved["state"]}


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_adapters_optimizer_state_lives_on_storage_and_equals_in_memory_adamw(tmp_path, mode):
    folder = s.save_base(tmp_path / "base", hidden=64)
    reference = s.in_memory(folder)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    optimizer = s.adam(trainable)
    expected_losses = s.plain_loop(reference, optimizer.step, optimizer.zero_grad)
    expected = _state_by_name(optimizer, {id(p): n for n, p in reference.named_parameters()})

    model, off = s.served(folder, tmp_path / "swap", mode)
    with off:
        losses = s.plain_loop(model, off.step, off.zero_grad)
        assert losses == expected_losses
        names = {id(p): n for n, p in model.named_parameters()}
        adapters = {n for n, p in model.named_parameters() if p.requires_grad}
        assert len(adapters) == 8 and adapters == set(expected)
        # every adapter is stepped by an offloaded optimizer; between steps none of its state is in memory
        stepping = [
            o for o in off.optimizers if any(names.get(id(p)) in adapters for g in o.param_groups for p in g["params"])
        ]
        assert len(stepping) == 1
        (rest,) = stepping
        held = [t for state in rest.state.values() for t in state.values() if torch.is_tensor(t) and t.numel() > 1]
        assert held == []
        # the state is on storage: at least Adam's two fp32 moments of every adapter value are in the swap folder
        moments = sum(2 * 4 * p.numel() for n, p in model.named_parameters() if n in adapters)
        assert s.folder_bytes(tmp_path / "swap") >= moments
        # and read back it is the in-memory AdamW's state, bit for bit
        got = _state_by_name(rest, names)
        assert set(got) == adapters
        for name in adapters:
            assert got[name].keys() == expected[name].keys(), name
            for key, value in expected[name].items():
                assert torch.equal(torch.as_tensor(got[name][key]), torch.as_tensor(value)), (name, key)
