"""Parameter offload on real model code: tiny Hugging Face Llama and GPT-2 built from configs (random weights, no
downloads) against the same model in memory: no_grad logits, generate with the KV cache, training with the models'
defaults (use_cache left on, dropout), gradient checkpointing, frozen blocks, save_pretrained/from_pretrained, and
transformers.Trainer (also with a resident budget, evaluation and checkpoints during training)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from deepoffload import StreamOptions, TrainOptions  # noqa: E402
from deepoffload.swap.params import StreamedParameter, offload_parameters  # noqa: E402
from tests.support.stepping import offload_step, reference_step  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def llama(attention: str = "sdpa"):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attention,
    )
    return transformers.LlamaForCausalLM(config)


def gpt2(attention: str = "sdpa"):
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=64, attn_implementation=attention
    )
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": llama, "gpt2": gpt2}


def pair(name: str, attention: str = "sdpa"):
    torch.manual_seed(0)
    reference = MODELS[name](attention)
    return reference, copy.deepcopy(reference)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def tokens(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_and_generate_match(scratch, name):
    reference, model = pair(name)
    ids = tokens()
    with offload_parameters(model, str(scratch)), torch.no_grad():
        reference.eval(), model.eval()
        assert torch.equal(model(ids).logits, reference(ids).logits)
        prompt = ids[:1, :4]
        expected = reference.generate(prompt, max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), expected)
    logits = model(ids).logits  # after close (restoring by default) the model runs in memory as before
    assert torch.equal(logits, reference(ids).logits)


def train(model, step, ids, steps: int = 3) -> list[float]:
    losses = []
    for k in range(steps):
        torch.manual_seed(100 + k)  # the same dropout masks in both runs
        loss = model(ids, labels=ids).loss
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "name, attention, mode",
    [
        ("llama", "sdpa", "fused"),
        ("llama", "eager", "fused"),
        ("llama", "sdpa", "grads"),
        ("gpt2", "sdpa", "fused"),
        ("gpt2", "eager", "grads"),
    ],
)
def test_training_with_defaults_is_bit_identical(scratch, name, attention, mode):
    """model.train() with the config's defaults: use_cache on (a DynamicCache filled during the forward, which
    recomputation must not fill twice), dropout on for GPT-2."""
    reference, model = pair(name, attention)
    assert reference.config.use_cache
    reference.train(), model.train()
    optimizer = adam(reference.parameters())
    ids = tokens()
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=adam)) as offload:
        assert train(model, offload_step(offload), ids) == train(reference, reference_step(optimizer), ids)
        assert states_equal(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("name, mode", [("llama", "fused"), ("gpt2", "fused"), ("llama", "grads")])
def test_training_with_a_resident_budget_and_validation_is_bit_identical(scratch, tmp_path, name, mode):
    """max_resident_bytes holding some blocks (they step in memory, never written back), the model's defaults, an
    eval pass under no_grad between steps, then save_pretrained: all equal to the model trained in memory."""
    reference, model = pair(name)
    reference.train(), model.train()
    optimizer = adam(reference.parameters())
    ids, held_out = tokens(), tokens(seed=2)
    layers = model.base_model.get_submodule("layers" if name == "llama" else "h")
    budget = sum(p.numel() * p.element_size() for p in layers[0].parameters())  # about one block of three
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode=mode, optimizer=adam),
        stream=StreamOptions(max_resident_bytes=budget),
    ) as off:
        assert len(off.pinned) == 1
        for k in range(3):
            torch.manual_seed(100 + k)
            loss = model(ids, labels=ids).loss
            loss.backward()
            offload_step(off)()
            torch.manual_seed(100 + k)
            expected = reference(ids, labels=ids).loss
            expected.backward()
            reference_step(optimizer)()
            assert loss.item() == expected.item()
            model.eval(), reference.eval()
            with torch.no_grad():
                assert torch.equal(model(held_out).logits, reference(held_out).logits)
            model.train(), reference.train()
        model.save_pretrained(tmp_path / "saved")
    loaded = type(reference).from_pretrained(tmp_path / "saved")
    assert states_equal(loaded.state_dict(), reference.state_dict())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradient_checkpointing_is_bit_identical(scratch, name):
    reference, model = pair(name)
    for m in (reference, model):
        m.train()
        m.gradient_checkpointing_enable()
    optimizer = adam(reference.parameters())
    ids = tokens()
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)) as offload:
        assert train(model, offload_step(offload), ids) == train(reference, reference_step(optimizer), ids)
        assert states_equal(model.state_dict(), reference.state_dict())


def test_frozen_blocks_train_the_rest(scratch):
    reference, model = pair("llama")
    for m in (reference, model):
        m.model.layers.requires_grad_(False)
    optimizer = adam([p for p in reference.parameters() if p.requires_grad])
    ids = tokens()
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)) as offload:
        assert train(model, offload_step(offload), ids) == train(reference, reference_step(optimizer), ids)
        assert states_equal(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_pretrained_holds_the_trained_weights(scratch, tmp_path, name):
    reference, model = pair(name)
    optimizer = adam(reference.parameters())
    ids = tokens()
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)) as offload:
        train(model, offload_step(offload), ids, steps=2), train(reference, reference_step(optimizer), ids, steps=2)
        model.save_pretrained(tmp_path / "saved")
        assert all(
            isinstance(p, StreamedParameter)
            for p in model.base_model.get_submodule("layers" if name == "llama" else "h").parameters()
        )  # still streamed: the checkpoint was read from storage
        assert offload.stats.resident_bytes == 0
    loaded = type(reference).from_pretrained(tmp_path / "saved")
    assert states_equal(loaded.state_dict(), reference.state_dict())


def test_trainer_streams_the_blocks(scratch, tmp_path):
    """transformers.Trainer with trainer_arguments(offload): the same weights as a Trainer run in memory with the
    same optimizer and learning-rate schedule; max_grad_norm > 0 is refused (the Trainer would clip only the
    gradients in memory)."""
    from deepoffload import trainer_arguments

    reference, model = pair("llama")
    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 12), generator=generator)]

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    def arguments(**overrides):
        settings = dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            max_steps=3,
            max_grad_norm=0,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
        )
        return transformers.TrainingArguments(**{**settings, **overrides})

    transformers.Trainer(
        reference, arguments(), train_dataset=data, optimizers=(adamw(reference.parameters()), None)
    ).train()
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adamw)) as offload:
        transformers.Trainer(model, arguments(), train_dataset=data, **trainer_arguments(offload)).train()
        assert states_equal(model.state_dict(), reference.state_dict())
        with pytest.raises(ValueError, match="max_grad_norm"):
            transformers.Trainer(
                model, arguments(max_grad_norm=1.0), train_dataset=data, **trainer_arguments(offload)
            ).train()


@pytest.mark.parametrize("mode, accumulation", [("fused", 1), ("grads", 2)])
def test_trainer_with_a_resident_budget_evaluation_and_checkpoints(scratch, tmp_path, mode, accumulation):
    """transformers.Trainer over a model streamed with max_resident_bytes holding about half its blocks, with an
    evaluation pass and a checkpoint saved during training: the logged training and evaluation losses, the
    checkpoint's weights and the final parameters equal those of the same Trainer run in memory."""
    from safetensors.torch import load_file

    from deepoffload import trainer_arguments

    def build():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(config)

    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 12), generator=generator)]
    held_out = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (4, 12), generator=generator)]

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    def train(model, folder, **extra):
        args = transformers.TrainingArguments(
            output_dir=str(folder),
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            gradient_accumulation_steps=accumulation,
            max_steps=4,
            max_grad_norm=0,
            logging_steps=1,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            report_to=[],
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(model, args, train_dataset=data, eval_dataset=held_out, **extra)
        trainer.train()
        return [
            (entry["step"], entry.get("loss"), entry.get("eval_loss"))
            for entry in trainer.state.log_history
            if "loss" in entry or "eval_loss" in entry
        ]

    reference = build()
    expected = train(reference, tmp_path / "memory", optimizers=(adamw(reference.parameters()), None))
    model = build()
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode=mode, optimizer=adamw),
        stream=StreamOptions(max_resident_bytes=2 * layer_bytes),
    ) as offload:
        assert offload.pinned == {0, 1}
        logged = train(model, tmp_path / "streamed", **trainer_arguments(offload))
        assert offload.pinned == {0, 1}
        assert states_equal(model.state_dict(), reference.state_dict())
    assert len([e for e in logged if e[2] is not None]) == 2 and len(logged) == 6
    assert logged == expected
    assert states_equal(model.state_dict(), reference.state_dict())
    for step in (2, 4):
        saved = load_file(tmp_path / "streamed" / f"checkpoint-{step}" / "model.safetensors")
        assert states_equal(saved, load_file(tmp_path / "memory" / f"checkpoint-{step}" / "model.safetensors"))


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_trainer_resumes_a_streamed_run_from_an_in_memory_checkpoint(scratch, tmp_path, mode):
    """A Trainer checkpoint of a run in memory resumes streamed (Trainer(resume_from_checkpoint=...)) exactly when its
    optimizer named its parameters; one that did not is refused, and the refusal names what works: following it (an
    optimizer over model.named_parameters()) gives the weights of the uninterrupted in-memory run."""
    from deepoffload import trainer_arguments
    from deepoffload.errors import CheckpointError

    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 12), generator=generator)]

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    def trainer(model, folder, **extra):
        args = transformers.TrainingArguments(
            output_dir=str(folder),
            per_device_train_batch_size=2,
            max_steps=4,
            max_grad_norm=0,
            save_strategy="steps",
            save_steps=2,
            report_to=[],
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        return transformers.Trainer(model, args, train_dataset=data, **extra)

    unnamed, named, model = pair("llama")[0], *pair("llama")
    trainer(unnamed, tmp_path / "unnamed", optimizers=(adamw(unnamed.parameters()), None)).train()
    trainer(named, tmp_path / "named", optimizers=(adamw(named.named_parameters()), None)).train()
    assert states_equal(unnamed.state_dict(), named.state_dict())
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=adamw)) as offload:
        streamed = trainer(model, tmp_path / "streamed", **trainer_arguments(offload))
        with pytest.raises(CheckpointError, match=r"model\.named_parameters\(\)"):
            streamed.train(resume_from_checkpoint=str(tmp_path / "unnamed" / "checkpoint-2"))
        streamed = trainer(model, tmp_path / "streamed", **trainer_arguments(offload))
        streamed.train(resume_from_checkpoint=str(tmp_path / "named" / "checkpoint-2"))
        assert streamed.state.global_step == 4
        assert states_equal(model.state_dict(), named.state_dict())


def test_compute_dtype_bf16_on_a_float32_model(scratch):
    """fp32 Llama, blocks computing in bf16 (fp32 masters on storage): the same logits as an in-memory model whose
    decoder layers are bf16 and cast their floating inputs to bf16 and their outputs back to fp32."""
    from torch.utils import _pytree as pytree

    reference, model = pair("llama")
    for layer in reference.model.layers:
        layer.to(torch.bfloat16)
        inner = layer.forward

        def cast_forward(*args, _inner=inner, **kwargs):
            def to(dtype, only=None):
                return lambda x: (
                    x.to(dtype)
                    if isinstance(x, torch.Tensor) and x.is_floating_point() and (only is None or x.dtype == only)
                    else x
                )

            args, kwargs = pytree.tree_map(to(torch.bfloat16), (args, kwargs))
            return pytree.tree_map(to(torch.float32, torch.bfloat16), _inner(*args, **kwargs))

        layer.forward = cast_forward
    ids = tokens()
    with offload_parameters(model, str(scratch), stream=StreamOptions(compute_dtype=torch.bfloat16)), torch.no_grad():
        reference.eval(), model.eval()
        logits = model(ids).logits
        assert logits.dtype == torch.float32 and torch.equal(logits, reference(ids).logits)
