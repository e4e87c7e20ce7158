"""Serving a checkpoint with a codec (``serve_from_checkpoint=True``, ``SwapConfig(codec="lossless")``) writes a
compressed copy of the served blocks once, in the background, and says so (``storage/compressed_copy.py``): the
values are bit-identical before the copy is complete (served from the checkpoint), once it is (the same run switches
to it) and in later runs (read from the copy from the start, fewer bytes); a copy whose checkpoint changed is rebuilt,
never read. The crash-point harness kills the writer at every step (``tests/crash/scenarios.py``: ``compressed_copy``).
"""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch

from deepoffload import LoadOptions, SwapConfig, offload_parameters
from deepoffload.swap.params.storage import compressed_copy

pytest.importorskip("zstandard")
safetensors = pytest.importorskip("safetensors.torch")


def model(meta: bool = True) -> torch.nn.Module:
    with torch.device("meta" if meta else "cpu"):
        return torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)]).to(torch.bfloat16)


def save(folder, seed: int) -> tuple[str, torch.nn.Module]:
    torch.manual_seed(seed)
    reference = model(meta=False)
    path = str(folder / "model.safetensors")
    safetensors.save_file(reference.state_dict(), path)
    return path, reference


def serve(checkpoint: str, swap):
    load = LoadOptions(checkpoint=checkpoint, serve_from_checkpoint=True)
    config = SwapConfig(codec="lossless", pin=False)
    served = model()
    return served, offload_parameters(served, str(swap), load=load, config=config)


def codecs(offload) -> set[str]:
    return {r.codec for b in offload.blocks for r in offload.store.swapper.records(b.group).values()}


def copies(swap) -> list[str]:
    return sorted(n for n in os.listdir(swap) if n.startswith("deepoffload-copy-"))


def test_served_values_are_identical_before_and_after_the_copy_and_later_runs_read_it(scratch, monkeypatch):
    checkpoint, reference = save(scratch, 0)
    swap = scratch / "swap"
    swap.mkdir()
    x = torch.randn(3, 128).to(torch.bfloat16)
    with torch.no_grad():
        expected = reference(x)
    gate = threading.Event()
    build = compressed_copy.CompressedCopy._build
    monkeypatch.setattr(compressed_copy.CompressedCopy, "_build", lambda self: (gate.wait(60), build(self)))
    served, offload = serve(checkpoint, swap)
    with offload, torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = offload.stats.bytes_read
        assert torch.equal(served(x), expected)  # the copy is not written yet: served from the checkpoint
        raw = offload.stats.bytes_read - before
        assert codecs(offload) == {"none"}
        [warning] = [w for w in caught if "compressed copy" in str(w.message)]
        assert offload.store.copy.folder in str(warning.message)
        gate.set()
        assert offload.store.copy.wait()
        assert torch.equal(served(x), expected)  # this forward switches each block to the copy
        before = offload.stats.bytes_read
        assert torch.equal(served(x), expected)
        assert codecs(offload) == {"lossless"}
        assert 0 < offload.stats.bytes_read - before <= 0.75 * raw
    assert len(copies(swap)) == 1 and not [n for n in os.listdir(swap) if ".tmp-" in n]
    monkeypatch.setattr(compressed_copy.CompressedCopy, "_build", build)
    served, offload = serve(checkpoint, swap)  # a later run: the copy from the start, no warning
    with offload, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        before = offload.stats.bytes_read
        assert torch.equal(served(x), expected)
        assert codecs(offload) == {"lossless"} and offload.stats.bytes_read - before <= 0.75 * raw


def test_a_copy_whose_checkpoint_changed_is_rebuilt_never_read(scratch):
    checkpoint, _ = save(scratch, 0)
    swap = scratch / "swap"
    swap.mkdir()
    served, offload = serve(checkpoint, swap)
    with offload, pytest.warns(UserWarning, match="compressed copy"):
        with torch.no_grad():
            served(torch.zeros(1, 128, dtype=torch.bfloat16))
        assert offload.store.copy.wait()
    checkpoint, reference = save(scratch, 1)  # same names and shapes, other values
    x = torch.randn(3, 128).to(torch.bfloat16)
    with torch.no_grad():
        expected = reference(x)
    served, offload = serve(checkpoint, swap)
    with offload, torch.no_grad(), pytest.warns(UserWarning, match="compressed copy"):
        assert torch.equal(served(x), expected)  # from the checkpoint, while the stale copy is rebuilt
        assert offload.store.copy.wait()
        served(x)
        assert torch.equal(served(x), expected) and codecs(offload) == {"lossless"}
    assert len(copies(swap)) == 1


def test_a_run_closed_before_the_copy_is_complete_leaves_no_copy(scratch, monkeypatch):
    checkpoint, reference = save(scratch, 0)
    swap = scratch / "swap"
    swap.mkdir()
    started = threading.Event()
    write = compressed_copy.CompressedCopy._write_group

    def slow(self, *args):
        started.set()
        self._stop.wait(60)  # until close() stops it
        return write(self, *args)

    monkeypatch.setattr(compressed_copy.CompressedCopy, "_write_group", slow)
    served, offload = serve(checkpoint, swap)
    with offload, torch.no_grad(), pytest.warns(UserWarning, match="compressed copy"):
        served(torch.zeros(1, 128, dtype=torch.bfloat16))
        assert started.wait(60)
    assert copies(swap) == [] and not [n for n in os.listdir(swap) if "deepoffload-copy" in n]


def test_generate_from_a_save_pretrained_folder_gives_the_same_tokens_before_and_after_the_copy(scratch):
    transformers = pytest.importorskip("transformers")
    import deepoffload

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    reference.save_pretrained(scratch / "llama")
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        expected = reference.generate(ids, **greedy)
    load = LoadOptions(dtype=torch.bfloat16, serve_from_checkpoint=True)
    swap = scratch / "swap"
    swap.mkdir()
    for run in range(2):
        with pytest.warns(UserWarning, match="compressed copy") if run == 0 else warnings.catch_warnings():
            served, offload = deepoffload.from_pretrained(
                scratch / "llama", path=str(swap), load=load, config=SwapConfig(codec="lossless", pin=False)
            )
            with offload, torch.no_grad():
                assert torch.equal(served.generate(ids, **greedy), expected)
                assert offload.store.copy.wait()
                assert torch.equal(served.generate(ids, **greedy), expected)
                assert codecs(offload) == {"lossless"}


def test_a_backward_through_the_served_blocks_is_identical_before_and_after_the_copy(scratch, monkeypatch):
    """Training over a served base (frozen blocks, gradients flowing to what trains, as LoRA's do): the same
    gradients from the checkpoint's bytes and from the copy (the matrix's ``lora_served`` x ``codec`` cells train
    PEFT LoRA this way)."""
    checkpoint, reference = save(scratch, 0)
    reference.requires_grad_(False)
    swap = scratch / "swap"
    swap.mkdir()
    x = torch.randn(3, 128).to(torch.bfloat16).requires_grad_(True)
    reference(x).float().square().sum().backward()
    expected, x.grad = x.grad.clone(), None
    gate = threading.Event()
    build = compressed_copy.CompressedCopy._build
    monkeypatch.setattr(compressed_copy.CompressedCopy, "_build", lambda self: (gate.wait(60), build(self)))
    served, offload = serve(checkpoint, swap)
    served.requires_grad_(False)
    with offload, pytest.warns(UserWarning, match="compressed copy"):
        served(x).float().square().sum().backward()
        assert torch.equal(x.grad, expected) and codecs(offload) == {"none"}
        gate.set()
        assert offload.store.copy.wait()
        for _ in range(2):  # the first switches each block to the copy (forward, then backward's reads)
            x.grad = None
            served(x).float().square().sum().backward()
            assert torch.equal(x.grad, expected)
        assert codecs(offload) == {"lossless"}
