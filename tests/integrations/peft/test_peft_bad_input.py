"""Bad input to LoRA over a served base, each a clear error naming the parameter and what to do: adapters on
parameters outside the streamed blocks, a served base whose file changes or vanishes during training, an adapter
folder of another base's shapes."""

from __future__ import annotations

import os

import pytest
import torch

from deepoffload.errors import CheckpointError, ChecksumError, UnsupportedError
from tests.integrations.peft import served as s

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")


def test_an_adapter_on_a_parameter_outside_the_blocks_is_refused_naming_it(tmp_path):
    folder = s.save_base(tmp_path / "base")
    model, off = s.served(folder, tmp_path / "swap")
    with off:
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
        with pytest.raises(
            UnsupportedError,
            match=r"parameter lm_head\.weight is outside the streamed blocks.*"
            r"target_modules",
        ):
            wrapped(**s.batch(0))


@pytest.mark.parametrize("how", ["rewritten", "removed"])
def test_a_served_base_file_changed_during_training_is_an_error_never_other_values(tmp_path, how):
    folder = s.save_base(tmp_path / "base")
    model, off = s.served(folder, tmp_path / "swap")
    with off:
        s.plain_loop(model, off.step, off.zero_grad, steps=1)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        (shard,) = folder.glob("*.safetensors")
        if how == "rewritten":  # same size, other values (a new save_pretrained over it)
            data = bytearray(shard.read_bytes())
            data[-64:] = bytes(64)
            shard.write_bytes(bytes(data))
        else:
            os.unlink(shard)
        model.train()
        with pytest.raises(
            ChecksumError,
            match=r"model\.layers\.0\..*served from .*\.safetensors, which was "
            r"replaced, rewritten or removed since.*Put the file back.*load the model again",
        ):
            model(**s.batch(1)).loss.backward()
        after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        assert len(before) == 8 and all(torch.equal(before[k], after[k]) for k in before)
        off.close(restore=False)


def test_an_adapter_folder_of_another_base_is_refused_naming_the_parameter(tmp_path):
    other = s.save_base(tmp_path / "other", hidden=64)
    torch.manual_seed(1)
    adapter = peft.get_peft_model(s.in_memory(other).base_model.model, s.lora_config())
    adapter.save_pretrained(tmp_path / "adapter")

    folder = s.save_base(tmp_path / "base")  # hidden 32
    import deepoffload

    model, off = deepoffload.from_pretrained(
        folder, path=tmp_path / "swap", load=deepoffload.LoadOptions(serve_from_checkpoint=True)
    )
    match = r"parameter model\.layers\.0\.self_attn\.q_proj\.lora_A\.default\.weight .*shape \(4, 32\).*"
    match += r"shape \(4, 64\).*another base"
    with off, pytest.raises(CheckpointError, match=match):
        peft.PeftModel.from_pretrained(model, tmp_path / "adapter")


def test_adapters_after_offloading_with_compute_dtype_are_refused_before_a_step(tmp_path):
    """They computed in float32 inside blocks computing in bfloat16: losses differed from in-memory compute_dtype
    from the second step on (the differential matrix's compute_bf16 lora_served rows), with nothing raised."""
    import deepoffload
    from deepoffload.errors import StreamedParameterError

    folder = s.save_base(tmp_path / "base")
    model, off = deepoffload.from_pretrained(
        folder,
        path=tmp_path / "swap",
        train=deepoffload.TrainOptions(s.adam),
        load=deepoffload.LoadOptions(serve_from_checkpoint=True),
        stream=deepoffload.StreamOptions(compute_dtype=torch.bfloat16),
    )
    with off:
        wrapped = peft.get_peft_model(model, s.lora_config())
        with pytest.raises(StreamedParameterError, match=r"lora_A.*compute_dtype=torch\.bfloat16.*torch\.autocast"):
            wrapped(**s.batch(0))
