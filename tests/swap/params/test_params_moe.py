"""Mixture-of-Experts models from their save_pretrained folders: same tokens as in memory, experts read one by one.

transformers (5.x) fuses each layer's experts (``experts.gate_up_proj``/``down_proj``, first dimension the expert);
save_pretrained writes them per expert (Qwen-MoE, DeepSeek) or fused (Mixtral). ``from_pretrained`` converts them by
transformers' own mappings; an inference forward then reads the attention, the router and the chosen experts only.
"""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
import transformers as T

import deepoffload
from deepoffload import StreamOptions, TrainOptions
from tests.support.moe_models import moe_model

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
FAMILIES = {
    name: (lambda name=name: moe_model(name, SMALL, experts=8, shared=True))
    for name in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
}


def saved(tmp_path, name):
    torch.manual_seed(0)
    ref = FAMILIES[name]().eval()
    with contextlib.redirect_stdout(io.StringIO()):
        ref.save_pretrained(tmp_path / "ckpt")
    return ref


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_moe_folder_generates_the_same_tokens_reading_only_chosen_experts(tmp_path, name):
    """Greedy generate of 24 tokens from the save_pretrained folder equals transformers' in memory, and the bytes
    read are at most 0.45 of reading every block whole each step (top-2 of 8; where shared experts and attention
    are most of a tiny layer, as in these tiny Qwen and DeepSeek configs, at most 0.75)."""
    ref = saved(tmp_path, name)
    model, off = deepoffload.from_pretrained(tmp_path / "ckpt", path=tmp_path / "swap")
    ids = torch.tensor([[3, 17, 5, 40, 9, 22]])
    with off, torch.no_grad():
        assert len(off.experts.experts) == 2  # one experts module per layer, found by what transformers' are
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
        whole = sum(b.nbytes for b in off.blocks) * 24  # every block read once per forward
        assert torch.equal(out, ref.generate(ids, max_new_tokens=24, do_sample=False))
        assert off.stats.bytes_read <= (0.45 if name == "mixtral" else 0.75) * whole
        # experts read one by one and cached (the cache is dropped after each step: its block was written)
        assert off.experts.stats.misses > 0 and off.experts.stats.hits + off.experts.stats.misses >= 24 * 2 * 2


def test_early_router_and_cache_change_no_token(tmp_path):
    """The next layer's router, applied early, reads experts ahead (speculative); a cache within max_resident_bytes
    keeps the most used ones: the same tokens; a block read whole (state_dict) holds every expert."""
    ref = saved(tmp_path, "mixtral")
    ids = torch.tensor([[3, 17, 5, 40, 9, 22]])
    expected = ref.generate(ids, max_new_tokens=24, do_sample=False)
    for budget in (None, 10**6):
        model, off = deepoffload.from_pretrained(
            tmp_path / "ckpt", path=tmp_path / f"swap{budget}", stream=StreamOptions(max_resident_bytes=budget)
        )
        if budget:
            off.set_max_resident_bytes(off.blocks[0].nbytes // 4)  # no block fits: all of it for experts
        with off, torch.no_grad():
            assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False), expected)
            stats = off.experts.stats
            assert stats.prefetched > 0 and stats.prefetch_accuracy is not None
            if budget:
                assert 0 < stats.cached_bytes <= off.blocks[0].nbytes // 4
                assert stats.hits > stats.prefetch_used  # hits beyond the ones read ahead: the cache kept them
            state = off.state_dict()
            assert torch.equal(state["model.layers.1.mlp.experts.down_proj"], ref.model.layers[1].mlp.experts.down_proj)


def test_training_through_moe_blocks_reads_them_whole_and_stays_exact(tmp_path):
    """A training forward (and its recompute) reads the whole block, so gradients of every expert and the router's
    auxiliary loss are those of memory: two SGD steps equal bit for bit; inference between them sees the new
    weights (nothing stale in the expert cache)."""
    torch.manual_seed(0)
    cfg = T.MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.1)
    ref = T.MixtralForCausalLM(cfg).train()
    model = copy.deepcopy(ref)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    optimizer = sgd(ref.parameters())
    ids = torch.tensor([[3, 17, 5, 40, 9, 22, 7, 8]])
    with deepoffload.offload_parameters(
        model, str(tmp_path), train=TrainOptions(optimizer=sgd), stream=StreamOptions(max_resident_bytes=10**6)
    ) as off:
        off.set_max_resident_bytes(2 * off.blocks[0].nbytes - 1)  # block 0 pinned; the rest for layer 1's experts
        for _ in range(2):
            model.eval(), ref.eval()
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref(ids).logits)
            model.train(), ref.train()
            a = model(ids, labels=ids)
            a.loss.backward()
            off.step()
            off.zero_grad()
            b = ref(ids, labels=ids)
            b.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert torch.equal(a.loss, b.loss)
        assert off.experts.stats.misses > 0 and off.experts.stats.cached_bytes > 0
        state = off.state_dict()
        assert [k for k, v in ref.state_dict().items() if not torch.equal(state[k], v)] == []


def test_a_change_to_a_block_read_without_its_experts_is_refused(tmp_path):
    """Writing back a block read without its experts would write expert bytes never read: a parameter changed in
    place during an inference forward is refused (the change dropped, the stored values kept), naming why."""
    ref = saved(tmp_path, "mixtral")
    model, off = deepoffload.from_pretrained(tmp_path / "ckpt", path=tmp_path / "swap")
    attention = model.model.layers[0].self_attn

    def change(module, args):
        module.q_proj.weight.add_(0)  # (in place: a change user code made)

    handle = attention.register_forward_pre_hook(change)
    ids = torch.tensor([[3, 17, 5]])
    with off, torch.no_grad():
        with pytest.raises(deepoffload.StreamedParameterError, match="read without its experts"):
            model(ids)
        handle.remove()
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_a_corrupt_expert_read_alone_raises_a_checksum_error_naming_it(tmp_path):
    """With checksums, each expert's slice of a fused record carries its own, checked when read alone: one expert's
    bytes changed on storage raise a ChecksumError naming that expert, its parameter and block (never wrong values)."""
    saved(tmp_path, "mixtral")
    config = deepoffload.SwapConfig(checksum=True)
    model, off = deepoffload.from_pretrained(tmp_path / "ckpt", path=tmp_path / "swap", config=config)
    entry = off.experts.experts[0]
    chosen: list[int] = []
    handle = entry.spec.module.register_forward_pre_hook(lambda m, args: chosen.extend(args[1].unique().tolist()))
    ids = torch.tensor([[3, 17, 5]])
    with torch.no_grad():
        model(ids)
        handle.remove()
        assert off.blocks[0].read_partly  # (checksummed records are still read by slices)
        record = off.store.swapper.records(entry.block.group)[entry.names[1]]
        expert = chosen[0]
        size = record.nbytes // record.shape[0]
        with open(record.file, "r+b") as f:
            f.seek(record.offset + expert * size + size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
        name = f"model.layers.0.{entry.names[1]}"
        with pytest.raises(deepoffload.ChecksumError, match=rf"expert {expert} of parameter {name}"):
            model(ids)
    off.close(restore=False)  # (restoring reads the corrupt record whole: its own checksum refuses it)
