"""``StorageCache``: the same tokens as ``DynamicCache`` (greedy, sampling with a seed, beam search, chunked prefill,
streamed weights), keys and values on storage between forwards with at most ``resident_layers`` layers read, and
the Cache API it refuses (crop, batch changes, sliding-window layers)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from transformers import DynamicCache

import deepoffload
from deepoffload import ClosedError, StorageCache, UnsupportedError

from .helpers import FLUSH, dynamic_and_storage, generate, llama, prompt

MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=20, temperature=0.9),
    "beam": dict(do_sample=False, num_beams=3),
    "beam_sampling": dict(do_sample=True, num_beams=2, num_return_sequences=2),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_same_tokens_as_dynamic_cache(scratch, mode):
    model, ids = llama(), prompt()
    reference, tokens, stats = dynamic_and_storage(model, ids, scratch, **MODES[mode])
    assert torch.equal(reference, tokens), (reference, tokens)
    assert stats["bytes_written"] > 0 and stats["bytes_read"] > 0, stats


def test_beam_search_needs_the_reordering(scratch, monkeypatch):
    """Proof that the beam test above exercises ``reorder_cache``: without it the tokens differ."""
    model, ids = llama(), prompt()
    reference, tokens, _ = dynamic_and_storage(model, ids, scratch, **MODES["beam"])
    assert torch.equal(reference, tokens)
    monkeypatch.setattr(deepoffload.kv.layer.StorageLayer, "reorder_cache", lambda self, beam_idx: None)
    _, broken, _ = dynamic_and_storage(model, ids, scratch, **MODES["beam"])
    assert not torch.equal(reference, broken)


def test_chunked_prefill_same_tokens_and_bounded_reads(scratch):
    """``generate(prefill_chunk_size=n)`` runs a long prompt in chunks; each chunk reads the layer's stored tokens."""
    model, ids = llama(), prompt(batch=1, tokens=64)
    reference = generate(model, ids, DynamicCache(config=model.config), prefill_chunk_size=16, do_sample=False)
    with StorageCache(scratch, config=model.config, flush_bytes=FLUSH) as cache:
        tokens = generate(model, ids, cache, prefill_chunk_size=16, do_sample=False)
        stats = cache.stats()
    assert torch.equal(reference, tokens)
    assert stats["tokens"] == 64 + 10 - 1 and stats["bytes_read"] > 0


@pytest.mark.parametrize("resident_layers", [1, 2, 4])
def test_between_forwards_only_the_tails_and_reads_ahead_are_in_memory(scratch, resident_layers):
    model, ids = llama(layers=4), prompt(batch=1, tokens=200)
    with StorageCache(scratch, config=model.config, resident_layers=resident_layers, flush_bytes=FLUSH) as cache:
        generate(model, ids, cache, do_sample=False, max_new_tokens=3)
        stats = cache.stats()
        assert all(layer.keys is None and layer.values is None for layer in cache.layers)
        assert len(cache._reads) == min(resident_layers, 4) - 1  # layer 0 (and on) read ahead for the next forward
        assert stats["bytes_in_memory"] <= 2 * 4 * FLUSH < stats["bytes_stored"], stats
        files = sorted(os.listdir(cache.folder))
        sizes = {name: os.path.getsize(os.path.join(cache.folder, name)) for name in files if name.startswith("layer")}
    assert sorted(sizes) == sorted(f"layer{i}.{kind}" for i in range(4) for kind in ("keys", "values"))
    assert sum(sizes.values()) == stats["bytes_written"] > 0


def test_with_streamed_weights_from_pretrained(scratch, tmp_path):
    """Weights streamed by ``deepoffload.from_pretrained`` and the KV on storage: the in-memory model's tokens."""
    model, ids = llama(), prompt()
    model.save_pretrained(tmp_path / "model")
    reference = generate(model, ids, DynamicCache(config=model.config), do_sample=False)
    streamed, offload = deepoffload.from_pretrained(tmp_path / "model", path=str(scratch))
    try:
        streamed.eval()
        with StorageCache(scratch, config=streamed.config, flush_bytes=FLUSH) as cache:
            tokens = generate(streamed, ids, cache, do_sample=False)
            assert cache.stats()["bytes_written"] > 0
    finally:
        offload.close()
    assert torch.equal(reference, tokens)


def test_a_sliding_window_model_is_refused_and_dynamic_cache_works(scratch):
    config = transformers.MistralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    with pytest.raises(UnsupportedError, match="sliding_attention.*DynamicCache"):
        StorageCache(scratch, config=config)
    model = transformers.MistralForCausalLM(config).eval()
    ids = prompt(batch=1, tokens=12)
    assert generate(model, ids, DynamicCache(config=config), do_sample=False).shape == (1, 22)
    assert os.listdir(scratch) == []


def test_refused_cache_api_on_a_filled_cache(scratch):
    model, ids = llama(), prompt()
    with StorageCache(scratch, config=model.config) as cache:
        generate(model, ids, cache, do_sample=False, max_new_tokens=2)
        cache.crop(0)
        for call in (
            lambda: cache.crop(-1),
            lambda: cache.batch_repeat_interleave(2),
            lambda: cache.batch_select_indices(torch.tensor([0])),
            lambda: cache.reorder_cache(torch.tensor([0, 1, 1])),
        ):
            with pytest.raises(UnsupportedError, match="append-only"):
                call()
        with pytest.raises(UnsupportedError, match="change of batch"):
            cache.update(torch.zeros(3, 2, 1, 16), torch.zeros(3, 2, 1, 16), 0)
        assert cache.get_seq_length() == 21


def test_reset_then_a_new_generation(scratch):
    model, ids = llama(), prompt()
    reference = generate(model, ids, DynamicCache(config=model.config), do_sample=False)
    with StorageCache(scratch, config=model.config, flush_bytes=FLUSH) as cache:
        generate(model, prompt(seed=5), cache, do_sample=False)
        cache.reset()
        assert cache.get_seq_length() == 0
        assert torch.equal(reference, generate(model, ids, cache, do_sample=False))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_arguments(scratch, bad):
    config = llama().config
    with pytest.raises(ValueError, match="resident_layers"):
        StorageCache(scratch, config=config, resident_layers=bad)
    with pytest.raises(ValueError, match="flush_bytes"):
        StorageCache(scratch, config=config, flush_bytes=bad)
    with pytest.raises(TypeError, match="config"):
        StorageCache(scratch, config={"num_hidden_layers": 2})


def test_close_removes_the_files_and_refuses_later_use(scratch):
    model, ids = llama(), prompt()
    cache = StorageCache(scratch, config=model.config, flush_bytes=FLUSH)
    generate(model, ids, cache, do_sample=False, max_new_tokens=2)
    assert os.listdir(cache.folder)
    cache.close()
    cache.close()
    assert os.listdir(scratch) == []
    with pytest.raises(ClosedError, match="after close"):
        generate(model, ids, cache, do_sample=False, max_new_tokens=2)


def test_keep_files_keeps_them(scratch):
    model, ids = llama(), prompt()
    with StorageCache(scratch, config=model.config, swap=deepoffload.SwapConfig(keep_files=True)) as cache:
        generate(model, ids, cache, do_sample=False, max_new_tokens=2)
    assert os.path.isdir(cache.folder)


def test_decode_reads_into_reused_buffers_and_never_overwrites_a_held_tensor(scratch):
    """A decoded token's layer comes back as a view of a reused read buffer (no fresh memory, no copy of the stored
    tokens per token); a tensor the caller still holds is never one the next reads go into."""
    model, ids = llama(), prompt()
    with StorageCache(scratch, config=model.config, flush_bytes=FLUSH) as cache:
        generate(model, ids, cache, do_sample=False, max_new_tokens=3)
        allocated = cache._buffers.allocated
        k = torch.randn(2, 2, 1, 16)
        keys, values = cache.update(k, k, 0)
        assert keys._base is not None and torch.equal(keys[:, :, -1:], k)  # in place, the new token last
        held = keys.clone()
        for _ in range(3):  # more forwards: every layer read again, the held one's buffer must not be reused
            with torch.no_grad():
                model(torch.tensor([[5], [6]]), cache=cache, use_cache=True)
        assert torch.equal(keys, held)
        del keys, values
        for _ in range(3):
            with torch.no_grad():
                model(torch.tensor([[5], [6]]), cache=cache, use_cache=True)
        # a fresh buffer per read would be 3 forwards x 3 layers x 2 streams of at least a layer's bytes; reused
        # buffers are only replaced as they grow (room for an eighth more) or while held
        assert cache._buffers.allocated - allocated < 3 * 3 * 2 * held.nbytes / 2
