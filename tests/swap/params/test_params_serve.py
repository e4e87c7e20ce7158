"""Inference weights served straight from a safetensors checkpoint (``serve_from_checkpoint=True``): the blocks'
records point into the checkpoint file, nothing is written to the swap folder, logits and generate equal the copied
path's, and anything that would write the checkpoint (a backward training a served block, a changed parameter being
released) raises a clear error and leaves the file unchanged."""

from __future__ import annotations

import hashlib

import pytest
import torch

from deepoffload import LoadOptions, StreamOptions, TrainOptions
from deepoffload.formats import save_sharded
from deepoffload.swap.params import offload_parameters
from deepoffload.swap.params.blocks.residency import Residency, span

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def llama_config(layers: int = 3):
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def meta_llama(layers: int = 3):
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(llama_config(layers))


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(seed))


def offload(model, path, load: LoadOptions | None = None, **options):
    """``offload_parameters`` with the model's own initializer for what no checkpoint holds (rotary ``inv_freq``)."""
    return offload_parameters(model, path, load=(load or LoadOptions()).replace(init=model._init_weights), **options)


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def reference():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config()).eval()


@pytest.fixture
def checkpoint(reference, scratch):
    from safetensors.torch import save_file

    path = scratch / "model.safetensors"
    save_file(reference.state_dict(), str(path))
    return path


def swap_files(off) -> list:
    import os

    return [name for name in os.listdir(off.store.swapper.folder) if name.endswith(".swp")]


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_served_blocks_equal_the_copied_path_and_write_nothing(scratch, reference, checkpoint, compute_dtype):
    before = digest(checkpoint)
    ids = tokens()
    copied_model, served_model = meta_llama(), meta_llama()
    with (
        offload(
            copied_model,
            str(scratch / "copied"),
            load=LoadOptions(checkpoint=checkpoint),
            stream=StreamOptions(compute_dtype=compute_dtype),
        ) as copied,
        offload(
            served_model,
            str(scratch / "served"),
            load=LoadOptions(checkpoint=checkpoint, serve_from_checkpoint=True),
            stream=StreamOptions(compute_dtype=compute_dtype),
        ) as served,
        torch.no_grad(),
    ):
        assert copied.stats.bytes_written > 0 and all(b.served is None for b in copied.blocks)
        assert served.stats.bytes_written == 0 and swap_files(served) == []
        assert all(b.served == str(checkpoint) for b in served.blocks)
        for block in served.blocks:
            records = served.store.swapper.records(block.group)
            assert {r.file for r in records.values()} == {str(checkpoint)}
        assert any(r.offset % 512 for b in served.blocks for r in served.store.swapper.records(b.group).values())
        assert torch.equal(served_model(ids).logits, copied_model(ids).logits)
        assert torch.equal(
            served_model.generate(ids, max_new_tokens=4, do_sample=False),
            copied_model.generate(ids, max_new_tokens=4, do_sample=False),
        )
        assert served.stats.bytes_read > 0 and served.stats.bytes_written == 0
        state = served.state_dict()
        assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    assert digest(checkpoint) == before
    assert all(torch.equal(a, b) for a, b in zip(served_model.parameters(), reference.parameters()))


def test_sharded_checkpoint_serves_the_blocks_inside_one_shard(scratch, reference):
    folder = scratch / "sharded"
    save_sharded(reference.state_dict(), folder, max_shard_bytes=60_000)
    ids = tokens()
    model = meta_llama()
    with (
        offload(model, str(scratch / "swap"), load=LoadOptions(checkpoint=folder, serve_from_checkpoint=True)) as off,
        torch.no_grad(),
    ):
        served = [b for b in off.blocks if b.served is not None]
        assert served and all(b.served.startswith(str(folder)) for b in served)
        assert off.stats.bytes_written == sum(span(b.masters) for b in off.blocks if b.served is None) > 0
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_budget_pins_served_blocks_and_unpins_them_without_a_write(scratch, reference, checkpoint):
    ids = tokens()
    model = meta_llama()
    with (
        offload(
            model,
            str(scratch / "swap"),
            load=LoadOptions(checkpoint=checkpoint, serve_from_checkpoint=True),
            stream=StreamOptions(max_resident_bytes=1 << 30),
        ) as off,
        torch.no_grad(),
    ):
        assert off.pinned == {0, 1, 2}
        setup = off.stats.bytes_read
        assert torch.equal(model(ids).logits, reference(ids).logits)
        assert off.stats.bytes_read == setup
        off.set_max_resident_bytes(0)
        assert off.pinned == frozenset() and off.stats.bytes_written == 0
        assert all(b.state is Residency.ON_STORAGE for b in off.blocks)
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("how", ["replaced", "rewritten in place"])
def test_a_checkpoint_changed_under_a_served_model_is_refused(scratch, reference, checkpoint, how):
    """Saving other weights to the served checkpoint's path (a new file renamed over it, or the same file rewritten)
    must not make the model compute with them silently."""
    import os

    from safetensors.torch import save_file

    from deepoffload.errors import ChecksumError

    ids = tokens()
    model = meta_llama().eval()
    with offload(
        model, str(scratch / "swap"), load=LoadOptions(checkpoint=checkpoint, serve_from_checkpoint=True)
    ) as off:
        with torch.no_grad():
            first = model(ids).logits
        other = {k: v + 1 if v.is_floating_point() else v for k, v in reference.state_dict().items()}
        if how == "replaced":
            save_file(other, str(scratch / "new.safetensors"))
            os.replace(scratch / "new.safetensors", checkpoint)
        else:
            save_file(other, str(scratch / "new.safetensors"))
            checkpoint.write_bytes((scratch / "new.safetensors").read_bytes())
        with pytest.raises(OSError, match="replaced, rewritten or removed") as raised, torch.no_grad():
            model(ids)
        assert isinstance(raised.value, ChecksumError) or isinstance(raised.value.__cause__, ChecksumError)
        off.close(restore=False)
    assert first.isfinite().all()


def test_training_a_served_block_is_refused_and_the_checkpoint_is_unchanged(scratch, checkpoint):
    before = digest(checkpoint)
    ids = tokens()
    model = meta_llama().train()
    with offload(
        model,
        str(scratch / "swap"),
        train=TrainOptions(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)),
        load=LoadOptions(checkpoint=checkpoint, serve_from_checkpoint=True),
    ) as off:
        loss = model(ids, labels=ids).loss
        with pytest.raises(RuntimeError, match="served read-only from the checkpoint .*serve_from_checkpoint"):
            loss.backward()
        assert off.stats.bytes_written == 0
    assert digest(checkpoint) == before


def test_a_changed_served_block_is_dropped_with_an_error(scratch, reference, checkpoint):
    before = digest(checkpoint)
    ids = tokens()
    model = meta_llama()
    with (
        offload(
            model,
            str(scratch / "swap"),
            load=LoadOptions(checkpoint=checkpoint, serve_from_checkpoint=True),
            stream=StreamOptions(max_resident_bytes=1 << 30),
        ) as off,
        torch.no_grad(),
    ):
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
        with pytest.raises(RuntimeError, match="up_proj.weight was changed in place.*served read-only.*dropped"):
            off.set_max_resident_bytes(0)
        assert torch.equal(model(ids).logits, reference(ids).logits)
        assert off.stats.bytes_written == 0
    assert digest(checkpoint) == before


def test_serving_needs_a_safetensors_checkpoint(scratch, reference):
    with pytest.raises(ValueError, match="needs checkpoint="):
        offload(meta_llama(), str(scratch), load=LoadOptions(serve_from_checkpoint=True))
    torch.save(reference.state_dict(), scratch / "model.pt")
    with pytest.raises(ValueError, match="needs a safetensors checkpoint"):
        offload(
            meta_llama(), str(scratch), load=LoadOptions(checkpoint=scratch / "model.pt", serve_from_checkpoint=True)
        )


def test_blocks_converted_to_another_dtype_are_copied(scratch, reference, checkpoint):
    ids = tokens()
    model, copied = meta_llama(), meta_llama()
    with (
        offload(
            model,
            str(scratch / "a"),
            load=LoadOptions(checkpoint=checkpoint, serve_from_checkpoint=True, dtype=torch.bfloat16),
        ) as off,
        offload(copied, str(scratch / "b"), load=LoadOptions(checkpoint=checkpoint, dtype=torch.bfloat16)),
        torch.no_grad(),
    ):
        assert all(b.served is None for b in off.blocks) and off.stats.bytes_written > 0
        assert torch.equal(model(ids).logits, copied(ids).logits)


def test_map_group_reads_tensors_where_they_lie_and_never_writes_there(scratch):
    from deepoffload.errors import ChecksumError
    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.tensor_swapper import SwapRecord, TensorSwapper

    a, b = torch.arange(1000, dtype=torch.float32), torch.arange(300, dtype=torch.int16)
    data = b"x" * 4108 + a.numpy().tobytes() + b.numpy().tobytes() + b"tail"  # starts 12 bytes past a page
    path = scratch / "foreign.bin"
    path.write_bytes(data)
    cpu = torch.device("cpu")
    records = {
        "a": SwapRecord("a", a.dtype, (1000,), 4000, str(path), 4108, cpu),
        "b": SwapRecord("b", b.dtype, (300,), 600, str(path), 8108, cpu),
    }
    with TensorSwapper(SwapConfig(folder=str(scratch / "swap"))) as swapper:
        swapper.map_group("g", records)
        assert swapper.mapped("g")
        read = swapper.swap_in(["g"])
        got = read.wait()["g"]
        assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
        read.release()
        with pytest.raises(PermissionError, match="read-only"):
            swapper.swap_out({"g": {"a": a}})
        path.write_bytes(data[:-4] + b"TAIL")  # rewritten after it was mapped
        with pytest.raises(ChecksumError, match="rewritten"):
            swapper.swap_in(["g"])
        swapper.discard("g")
        assert not swapper.has("g")
        gap = dict(records, b=SwapRecord("b", b.dtype, (300,), 600, str(path), 8200, cpu))
        with pytest.raises(ValueError, match="back to back"):
            swapper.map_group("h", gap)
    assert path.read_bytes() == data[:-4] + b"TAIL"
