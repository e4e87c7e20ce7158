"""Merging adapters over a served base: ``merge_and_unload`` is refused (it would write into the served checkpoint),
naming ``save_merged``, which writes the merged model to a new folder, bit-identical to ``merge_and_unload`` in memory;
``save_pretrained`` of the PEFT model writes the adapter alone."""

from __future__ import annotations

import hashlib

import pytest
import torch

from deepoffload.errors import StreamedParameterError, UnsupportedError
from deepoffload.integrations.peft import save_merged
from tests.integrations.peft import served as s

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_merge_and_unload_is_refused_and_save_merged_writes_what_it_would_in_memory(tmp_path):
    from safetensors.torch import load_file

    folder = s.save_base(tmp_path / "base")
    before = _digest(folder)
    reference = s.in_memory(folder)
    optimizer = s.adam([p for p in reference.parameters() if p.requires_grad])
    s.plain_loop(reference, optimizer.step, optimizer.zero_grad, steps=2)
    expected = reference.merge_and_unload().state_dict()

    model, off = s.served(folder, tmp_path / "swap")
    with off:
        s.plain_loop(model, off.step, off.zero_grad, steps=2)
        model.save_pretrained(tmp_path / "adapter")
        saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
        assert len(saved) == 8 and all(".lora_" in k for k in saved)  # the adapter alone
        with pytest.raises(StreamedParameterError, match=r"served read-only.*merge_and_unload.*save_merged\(off, "):
            model.merge_and_unload()
        with pytest.raises(UnsupportedError, match="holds the checkpoint the base is served from"):
            save_merged(off, folder)
        save_merged(off, tmp_path / "merged")
    assert _digest(folder) == before  # the served checkpoint was only read
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    assert merged.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(merged[name], value), name
    base = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    changed = [n for n, v in base.items() if not torch.equal(merged[n], v)]
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed)
