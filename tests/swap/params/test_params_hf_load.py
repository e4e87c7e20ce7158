"""A Hugging Face model built on ``meta`` loads from its own ``save_pretrained`` folder without ``init=``: the
non-persistent buffers no checkpoint holds (rotary ``inv_freq``) are computed by the model's own ``_init_weights``,
as ``from_pretrained`` computes them."""

from __future__ import annotations

import pytest
import torch

from deepoffload import LoadOptions
from deepoffload.swap.params import offload_parameters
from tests.support.matrix_harness import batch, build

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_meta_model_loads_its_own_folder_without_init(scratch, name):
    pytest.importorskip("transformers")
    ref = build(name).eval()
    ref.save_pretrained(scratch / "ckpt")
    model = build(name, "meta").eval()
    with (
        offload_parameters(model, str(scratch / "swap"), load=LoadOptions(checkpoint=scratch / "ckpt")),
        torch.no_grad(),
    ):
        buffers = dict(ref.named_buffers())
        assert [n for n, b in model.named_buffers() if not torch.equal(b, buffers[n])] == []
        assert torch.equal(model(**batch(name, 0)).logits, ref(**batch(name, 0)).logits)


@pytest.mark.parametrize("name, shard", [("llama", "20KB"), ("t5", None)])
def test_from_pretrained_builds_on_meta_and_loads_streamed(scratch, name, shard):
    import deepoffload

    ref = build(name).eval()
    ref.save_pretrained(scratch / "ckpt", **({"max_shard_size": shard} if shard else {}))
    model, off = deepoffload.from_pretrained(
        scratch / "ckpt", path=str(scratch / "swap"), stream=deepoffload.StreamOptions(prefetch=0)
    )
    with off, torch.no_grad():
        assert type(model) is type(ref) and not model.training
        assert off.load_report == ([], [])
        assert torch.equal(model(**batch(name, 0)).logits, ref(**batch(name, 0)).logits)


def test_from_pretrained_refuses_a_folder_without_config(scratch):
    """A missing folder or config.json is a CheckpointNotFoundError: ``except FileNotFoundError`` (errno ENOENT, the
    missing file as ``filename``) and ``except CheckpointError`` both catch it."""
    import errno

    import deepoffload

    for folder in (scratch, scratch / "no_such_folder"):
        with pytest.raises(deepoffload.CheckpointNotFoundError, match="config.json") as info:
            deepoffload.from_pretrained(folder)
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, deepoffload.CheckpointError)
        assert (info.value.errno, info.value.filename) == (errno.ENOENT, str(folder / "config.json"))


def test_from_pretrained_trains_like_the_model_in_memory(scratch):
    """The guide's training loop (docs/guides/hugging-face.md): a model loaded by deepoffload.from_pretrained with
    optimizer= trains bit-identical to transformers' from_pretrained in memory with the same AdamW."""
    import transformers

    import deepoffload

    build("llama").save_pretrained(scratch / "ckpt")
    ref = transformers.AutoModelForCausalLM.from_pretrained(scratch / "ckpt").train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model, off = deepoffload.from_pretrained(
        scratch / "ckpt",
        path=str(scratch / "swap"),
        train=deepoffload.TrainOptions(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    )
    model.train()
    for step in range(3):
        inputs = batch("llama", step)
        ref(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
        model(**inputs).loss.backward()
        off.step()
        off.zero_grad()
    off.close()
    trained, expected = model.state_dict(), ref.state_dict()
    assert [n for n, t in expected.items() if not torch.equal(trained[n], t)] == []
