"""Models larger than memory on other architectures than Llama and GPT-2: tiny Hugging Face models built from
config classes (random weights, no downloads) on the meta device (``torch.device("meta")`` and accelerate's
``init_empty_weights()``), loaded from a sharded ``save_pretrained`` checkpoint (which drops tied copies), trained,
generated from, saved with ``off.save`` and freshly initialized, each against the same model in memory."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from deepoffload import LoadOptions, StreamOptions, TrainOptions  # noqa: E402
from deepoffload.swap.params import offload_parameters  # noqa: E402
from tests.support.stepping import offload_step, reference_step  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
T = transformers
SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def config(name: str):
    """(model class, config) of a tiny model."""
    return {
        "llama-tied": (T.LlamaForCausalLM, lambda: T.LlamaConfig(**SMALL, tie_word_embeddings=True)),
        "mistral": (T.MistralForCausalLM, lambda: T.MistralConfig(**SMALL, sliding_window=4)),
        "qwen2": (T.Qwen2ForCausalLM, lambda: T.Qwen2Config(**SMALL)),
        "gemma2": (T.Gemma2ForCausalLM, lambda: T.Gemma2Config(**SMALL, head_dim=8)),
        "phi3": (T.Phi3ForCausalLM, lambda: T.Phi3Config(**SMALL, pad_token_id=0)),
        "opt": (
            T.OPTForCausalLM,
            lambda: T.OPTConfig(
                vocab_size=64,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
                word_embed_proj_dim=32,
            ),
        ),
        "gpt-neox": (
            T.GPTNeoXForCausalLM,
            lambda: T.GPTNeoXConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
                rotary_pct=0.5,
            ),
        ),
        "mixtral": (T.MixtralForCausalLM, lambda: T.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2-moe": (
            T.Qwen2MoeForCausalLM,
            lambda: T.Qwen2MoeConfig(
                **SMALL,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
            ),
        ),
        "t5": (
            T.T5ForConditionalGeneration,
            lambda: T.T5Config(
                vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
            ),
        ),
        "bart": (
            T.BartForConditionalGeneration,
            lambda: T.BartConfig(
                vocab_size=64,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
            ),
        ),
        "bert": (
            T.BertForMaskedLM,
            lambda: T.BertConfig(
                vocab_size=64,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
            ),
        ),
    }[name]


def reference(name: str):
    cls, make = config(name)
    torch.manual_seed(0)
    return cls(make())


def empty(name: str, how: str):
    """The model built without memory: on meta, or by accelerate (parameters on meta, buffers in memory)."""
    cls, make = config(name)
    with torch.device("meta") if how == "meta" else accelerate.init_empty_weights():
        return cls(make())


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(seed))


def run(model, ids: torch.Tensor, labels: bool = False):
    if model.config.is_encoder_decoder:
        target = ids[:, :6].contiguous()
        return model(input_ids=ids, decoder_input_ids=target, labels=target if labels else None)
    return model(ids, labels=ids if labels else None)


def tied_groups(model) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(g for g in groups.values() if len(g) > 1)


def equal_states(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (or are missing from a)."""
    return [k for k in b if k not in a or not torch.equal(a[k], b[k])]


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def train_both(model, off, ref, optimizer, steps: int) -> list[list]:
    """``steps`` training steps of the streamed ``model`` and the in-memory ``ref`` on the same batches and seeds;
    each step's two outputs (streamed first)."""
    outputs = []
    for k in range(steps):
        ids = tokens(10 + k)
        pair = []
        for m, step in ((model, offload_step(off)), (ref, reference_step(optimizer))):
            torch.manual_seed(100 + k)
            out = run(m, ids, labels=True)
            out.loss.backward()
            step()
            pair.append(out)
        outputs.append(pair)
    return outputs


LOADED = ["llama-tied", "mistral", "qwen2", "gemma2", "phi3", "opt", "t5", "bart", "bert"]


@pytest.mark.parametrize("how", ["meta", "accelerate"])
@pytest.mark.parametrize("name", LOADED)
def test_sharded_save_pretrained_checkpoint_loads_like_in_memory(scratch, name, how):
    """Tied weights stay one parameter (accelerate's init_empty_weights() untied them: the checkpoint lacked the
    dropped copy, and with strict=False the head was freshly initialized), buffers equal the reference's."""
    ref = reference(name).eval()
    ref.save_pretrained(scratch / "ckpt", safe_serialization=True, max_shard_size="50KB")
    model = empty(name, how).eval()
    with (
        offload_parameters(
            model,
            str(scratch / "swap"),
            load=LoadOptions(checkpoint=scratch / "ckpt", init=model._init_weights, strict=False),
        ) as off,
        torch.no_grad(),
    ):
        assert off.load_report == ([], [])
        assert tied_groups(model) == tied_groups(ref)
        buffers = dict(ref.named_buffers())
        assert [n for n, b in model.named_buffers() if not torch.equal(b, buffers[n])] == []
        ids = tokens()
        assert torch.equal(run(model, ids).logits, run(ref, ids).logits)
        if hasattr(ref, "generate"):  # with the KV cache (T5, BART: an EncoderDecoderCache)
            prompt = ids[:1] if ref.config.is_encoder_decoder else ids[:1, :4]
            expected = ref.generate(prompt, max_new_tokens=5, do_sample=False)
            assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False), expected)
        if tied_groups(ref):  # an update to one tied name is seen through the others
            first, *others = tied_groups(model)[0]
            model.get_parameter(first).add_(1.0)
            assert all(torch.equal(model.get_parameter(o), model.get_parameter(first)) for o in others)


def save_unique(model, folder) -> None:
    """The model's state in its own names, each shared tensor once (what off.save writes)."""
    from deepoffload.formats.writer import save_sharded

    seen, state = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            state[name] = t.detach()
    save_sharded(state, folder, max_shard_bytes=50_000)


@pytest.mark.parametrize(
    "name, mode, half",
    [
        ("llama-tied", "fused", False),
        ("llama-tied", "grads", True),
        ("mistral", "fused", True),
        ("qwen2", "grads", False),
        ("gemma2", "fused", False),
        ("gemma2", "grads", True),
        ("phi3", "fused", True),
        ("opt", "grads", True),
        ("gpt-neox", "fused", False),
        ("mixtral", "fused", True),
        ("mixtral", "grads", False),
        ("qwen2-moe", "grads", True),
        ("bert", "fused", True),
    ],
)
def test_trains_generates_and_saves_like_in_memory(scratch, name, mode, half):
    """Built by accelerate, loaded, 3 Adam steps with the models' defaults (dropout, use_cache) bit-identical to
    in memory; generate with the KV cache; off.save() loads in from_pretrained equal to the trained model."""
    ref = reference(name).train()
    save_unique(ref, scratch / "ckpt")
    model = empty(name, "accelerate").train()
    budget = sum(p.numel() * p.element_size() for p in ref.parameters()) // 2 if half else None
    off = offload_parameters(
        model,
        str(scratch / "swap"),
        train=TrainOptions(mode=mode, optimizer=adam),
        load=LoadOptions(checkpoint=scratch / "ckpt"),
        stream=StreamOptions(max_resident_bytes=budget),
    )
    assert bool(off.pinned) == half
    for streamed, in_memory in train_both(model, off, ref, adam(ref.parameters()), 3):
        assert streamed.loss.item() == in_memory.loss.item()
    assert equal_states(off.state_dict(), ref.state_dict()) == []
    model.eval(), ref.eval()
    with torch.no_grad():
        ids = tokens()
        assert torch.equal(run(model, ids).logits, run(ref, ids).logits)
        if hasattr(ref, "generate"):
            prompt = ids[:1, :4]
            expected = ref.generate(prompt, max_new_tokens=5, do_sample=False)
            assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False), expected)
    off.save(scratch / "out")
    off.close()
    loaded = type(ref).from_pretrained(scratch / "out").eval()
    assert tied_groups(loaded) == tied_groups(ref)
    assert equal_states(loaded.state_dict(), ref.state_dict()) == []


@pytest.mark.parametrize("name", ["t5", "bart"])
@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_encoder_decoder_trains_with_its_defaults(scratch, name, mode):
    """use_cache on: an EncoderDecoderCache filled during the training forward (it was refused) ends as in memory.
    Not bit-identical: the encoder's output is read by every decoder block, and its gradient is summed per block
    (as reentrant gradient checkpointing sums it too), in another order than in memory: rounding differs. (SGD:
    Adam would blow up the rounding noise of gradients that are zero in exact arithmetic, e.g. the keys' bias.)"""
    ref = reference(name)
    model = copy.deepcopy(ref)
    assert ref.config.use_cache
    ref.train(), model.train()
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    optimizer = sgd(ref.parameters())
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=sgd)) as off:
        for k, outputs in enumerate(train_both(model, off, ref, optimizer, 3)):
            if k == 0:  # the forward is bit-identical: only the backward's sums differ
                assert outputs[0].loss.item() == outputs[1].loss.item()
            assert outputs[0].loss.item() == pytest.approx(outputs[1].loss.item(), rel=1e-5)
            caches = [o.past_key_values for o in outputs]  # BART turns the cache off when given labels; T5 not
            assert (caches[0] is None) == (caches[1] is None) == (name == "bart")
            for cache in caches if name == "t5" else ():
                assert cache.get_seq_length() == 6 and cache.cross_attention_cache.get_seq_length() == 10
                assert cache.is_updated == {0: True, 1: True}
        state, memory = off.state_dict(), ref.state_dict()
        assert all(torch.allclose(state[k], memory[k], rtol=1e-4, atol=1e-6) for k in memory)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_with_reentrant_checkpointing_is_bit_identical(scratch, name):
    """Both models under reentrant gradient checkpointing sum the encoder output's gradient per decoder block:
    streamed training is then bit-identical to in memory."""
    ref = reference(name).train()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with offload_parameters(model, str(scratch), train=TrainOptions(mode="grads", optimizer=adam)) as off:
        for streamed, in_memory in train_both(model, off, ref, adam(ref.parameters()), 2):
            assert streamed.loss.item() == in_memory.loss.item()
        assert equal_states(off.state_dict(), ref.state_dict()) == []


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_forward_with_gradients_is_bit_identical(scratch, name):
    """A block output that needs no gradient in memory (T5's cross-attention bias: zeros plus the mask) needs none
    from a streamed block either: it did, and the next block then took other kernels (logits differed by 7e-7)."""
    ref = reference(name).eval()
    model = copy.deepcopy(ref)
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)) as off:
        ids = tokens()
        out, expected = run(model, ids, labels=True), run(ref, ids, labels=True)
        assert torch.equal(out.logits, expected.logits)
        out.loss.backward()
        off.step()


@pytest.mark.parametrize(
    "name, how",
    [
        ("llama-tied", "meta"),
        ("gemma2", "accelerate"),
        ("bert", "accelerate"),
        ("mistral", "meta"),
        ("mixtral", "meta"),
    ],
)
def test_fresh_init_gives_initialize_weights_values(scratch, name, how):
    """init=model._init_weights without a checkpoint: the values of transformers' initialize_weights() with the
    same seed, tied weights included (each module holding them initializes them again; the last one's values stay)."""
    cls, make = config(name)
    ref = cls(make())
    for t in [*ref.modules(), *ref.parameters(), *ref.buffers()]:
        with contextlib.suppress(AttributeError):
            del t._is_hf_initialized
    torch.manual_seed(0)
    ref.initialize_weights()
    model = empty(name, how)
    torch.manual_seed(0)
    with offload_parameters(model, str(scratch), load=LoadOptions(init=model._init_weights)), torch.no_grad():
        assert tied_groups(model) == tied_groups(ref)
        assert equal_states(model.state_dict(), ref.state_dict()) == []
        ref.eval(), model.eval()
        assert torch.equal(run(model, tokens()).logits, run(ref, tokens()).logits)


@pytest.mark.parametrize("name", ["gpt-neox", "mixtral"])
def test_checkpoint_in_names_transformers_converts_loads_as_transformers_loads_it(scratch, name):
    """save_pretrained() writes GPT-NeoX's head as embed_out and Mixtral's experts one tensor each, sharded;
    checkpoint= converts them by transformers' own rules, as its from_pretrained does: the same state and logits."""
    ref = reference(name).eval()
    ref.save_pretrained(scratch / "ckpt", safe_serialization=True, max_shard_size="50KB")
    model = empty(name, "meta").eval()
    with (
        offload_parameters(model, str(scratch / "swap"), load=LoadOptions(checkpoint=scratch / "ckpt")) as off,
        torch.no_grad(),
    ):
        assert off.load_report == ([], [])
        assert equal_states(model.state_dict(), ref.state_dict()) == []
        assert torch.equal(run(model, tokens()).logits, run(ref, tokens()).logits)


@pytest.mark.parametrize("name", ["llama-tied", "gemma2", "t5", "bert"])
def test_serve_from_a_sharded_save_pretrained_checkpoint(scratch, name):
    """serve_from_checkpoint=True on a model built by accelerate: logits equal, the served blocks copied nowhere."""
    ref = reference(name).eval()
    ref.save_pretrained(scratch / "ckpt", safe_serialization=True, max_shard_size="50KB")
    model = empty(name, "accelerate").eval()
    with (
        offload_parameters(
            model, str(scratch / "swap"), load=LoadOptions(checkpoint=scratch / "ckpt", serve_from_checkpoint=True)
        ) as off,
        torch.no_grad(),
    ):
        served = [b for b in off.blocks if b.served]
        assert served  # blocks split over two shards are copied
        copied = sum(-(-b.nbytes // 4096) * 4096 for b in off.blocks if not b.served)  # whole pages
        assert off.stats.bytes_written <= copied < sum(-(-b.nbytes // 4096) * 4096 for b in off.blocks)
        assert torch.equal(run(model, tokens()).logits, run(ref, tokens()).logits)


@pytest.mark.parametrize("budget", [None, "all"])
def test_router_logits_recorded_inside_blocks_are_refused_in_training(scratch, budget):
    """output_router_logits=True (the MoE auxiliary loss): transformers records the router's logits with a hook
    inside each block, so a graph through the block's parameters outlived its forward. Back-propagated, it crashed
    on released parameters, or with every block resident trained silently other weights. Refused at the first
    training forward; inference with it (no_grad, or eval mode without it: then a backward through it raises), and
    training with output_hidden_states=True, stay allowed."""
    cls, make = config("mixtral")
    torch.manual_seed(0)
    ref = cls(make()).train()
    model = copy.deepcopy(ref)
    size = sum(p.numel() * p.element_size() for p in ref.parameters()) if budget else None
    ids = tokens()
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode="grads", optimizer=adam),
        stream=StreamOptions(max_resident_bytes=size),
    ) as off:
        with pytest.raises(
            ValueError, match="model.layers.0: a tensor computed inside it outlives.*output_router_logits=True"
        ):
            model(ids, labels=ids, output_router_logits=True)
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
            assert torch.equal(out.logits, ref(ids, output_router_logits=True).logits)
        model.eval(), ref.eval()  # a validation forward without no_grad is allowed; only a backward through it raises
        out = model(ids, output_router_logits=True)
        assert torch.equal(out.logits, ref(ids, output_router_logits=True).logits)
        with pytest.raises(ValueError, match="block model.layers.1: a tensor computed inside it outlives"):
            out.aux_loss.backward()
        del out
        model.train(), ref.train()
        optimizer = adam(ref.parameters())
        outputs = []
        for m, step in ((model, offload_step(off)), (ref, reference_step(optimizer))):
            outputs.append(m(ids, labels=ids, output_hidden_states=True))
            outputs[-1].loss.backward()
            step()
        assert all(torch.equal(a, b) for a, b in zip(outputs[0].hidden_states, outputs[1].hidden_states))
        assert equal_states(off.state_dict(), ref.state_dict()) == []


def test_a_block_output_read_twice_trains_within_rounding(scratch):
    """A hidden state used by the next block and by an extra loss term: its two gradients are summed in another
    order than in memory, so training agrees to rounding (docs/guides/parameter-streaming.md says so), not bit for
    bit."""
    ref = reference("mistral").train()
    model = copy.deepcopy(ref)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    optimizer = sgd(ref.parameters())
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=sgd)) as off:
        for k in range(3):
            ids = tokens(10 + k)
            losses = []
            for m, step in ((model, offload_step(off)), (ref, reference_step(optimizer))):
                out = m(ids, labels=ids, output_hidden_states=True)
                loss = out.loss + out.hidden_states[1].square().mean()
                loss.backward()
                step()
                losses.append(loss.item())
            assert losses[0] == pytest.approx(losses[1], rel=1e-6)
        state, memory = off.state_dict(), ref.state_dict()
        assert all(torch.allclose(state[k], memory[k], rtol=1e-5, atol=1e-7) for k in memory)


@pytest.mark.parametrize("name", ["llama-tied", "gemma2"])
def test_dtype_bf16_on_meta_equals_from_pretrained_in_bf16(scratch, name):
    """dtype=torch.bfloat16 converts the parameters made from meta, not the buffers: rotary inv_freq was made bf16
    (from_pretrained keeps it fp32), so positions were rounded and Llama's logits differed (by 1e-3)."""
    ref = reference(name)
    ref.save_pretrained(scratch / "ckpt", safe_serialization=True, max_shard_size="50KB")
    expected = type(ref).from_pretrained(scratch / "ckpt", dtype=torch.bfloat16).eval()
    model = empty(name, "meta").eval()
    with (
        offload_parameters(
            model,
            str(scratch / "swap"),
            load=LoadOptions(checkpoint=scratch / "ckpt", init=model._init_weights, dtype=torch.bfloat16),
        ),
        torch.no_grad(),
    ):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        assert torch.equal(model.model.rotary_emb.inv_freq, expected.model.rotary_emb.inv_freq)
        assert torch.equal(run(model, tokens()).logits, run(expected, tokens()).logits)
