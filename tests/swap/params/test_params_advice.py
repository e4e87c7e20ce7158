"""The refusals of offload_parameters() name an alternative a caller can type: each test meets a refusal, takes the
alternative's code from the message (so a message naming a keyword offload_parameters() no longer takes, such as
``optimizer=`` or ``init=``, fails here) and runs it to a working result."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from deepoffload import LoadOptions, StreamOptions, TrainOptions
from deepoffload.swap.params import offload_parameters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # O_DIRECT falls back on tmpfs, with a warning


def advised(message: str, pattern: str) -> str:
    """The code the message advises (the first group of ``pattern``); fails the test when the message has none."""
    found = re.search(pattern, message)
    assert found, f"no advice matching {pattern!r} in: {message}"
    return found.group(1)


def follow(advice: str, model: nn.Module, path, **names):
    """``offload_parameters(model, path, <advice>)``, the advice's names bound to ``names``."""
    scope = {"offload_parameters": offload_parameters, "model": model, "path": str(path), "torch": torch}
    scope.update(LoadOptions=LoadOptions, StreamOptions=StreamOptions, TrainOptions=TrainOptions, **names)
    return eval(f"offload_parameters(model, path, {advice})", scope)


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def tiny_llama_config(transformers):
    """A two-layer Llama config small enough to train in a test."""
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_step_without_train_advises_train_options_and_that_trains_as_in_memory(scratch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    reference = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 8)
    off = offload_parameters(model, str(scratch))
    with pytest.raises(ValueError, match="no optimizer") as refused:
        off.step()
    off.close()

    advice = advised(str(refused.value), r"pass (train=TrainOptions\(optimizer\))")
    off = follow(advice, model, scratch, optimizer=sgd)
    model(x).sum().backward()
    off.step()
    expected = sgd(reference.parameters())
    reference(x).sum().backward()
    expected.step()
    off.close()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


class Scale(nn.Module):
    """A parameter without reset_parameters(): on the meta device nothing gives it a value."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight


def test_a_meta_value_left_unset_advises_load_options_init_which_makes_it(scratch):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="without a value") as refused:
        offload_parameters(model, str(scratch))

    def init(module):
        if isinstance(module, Scale):
            nn.init.constant_(module.weight, 2.0)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    advice = advised(str(refused.value), r"pass (load=LoadOptions\(init=)\.\.\.\)") + "init)"
    off = follow(advice, model, scratch, init=init)
    with torch.no_grad():
        assert model(torch.ones(1, 4)).isfinite().all()
    assert torch.equal(model.state_dict()["1.weight"], torch.full((4,), 2.0))  # (read from storage)
    off.close()


class Rotary(nn.Module):
    """A block holding a non-persistent buffer that its own initializer does not set (as rotary embeddings do)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)

    def forward(self, x):
        return self.linear(x) * self.inv_freq


def test_an_unset_non_persistent_buffer_advises_load_options_init_which_sets_it(scratch):
    with torch.device("meta"):
        model = nn.Sequential(Rotary(), Rotary())

    def weights_only(module):
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    with pytest.raises(ValueError, match="non-persistent buffers") as refused:
        offload_parameters(model, str(scratch), load=LoadOptions(init=weights_only))

    def init(module):
        weights_only(module)
        if isinstance(module, Rotary):
            module.inv_freq.fill_(0.5)  # (in place, as transformers' initializers set buffers)

    advice = advised(str(refused.value), r"pass (load=LoadOptions\(init=)\.\.\.\)") + "init)"
    off = follow(advice, model, scratch, init=init)
    assert all(torch.equal(block.inv_freq, torch.full((4,), 0.5)) for block in model)
    off.close()


def test_converting_a_compute_dtype_model_advises_stream_options_which_computes_in_that_dtype(scratch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    in_memory = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    in_memory.load_state_dict(model.state_dict())
    x = torch.randn(2, 8, dtype=torch.float64)
    off = offload_parameters(model, str(scratch), stream=StreamOptions(compute_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="compute_dtype=torch.bfloat16 copies") as refused:
        model.double()
    off.close()  # (the refusal converted nothing: the model is given back as it was)
    assert all(p.dtype == torch.float32 for p in model.parameters())

    advice = advised(str(refused.value), r"offload it with (stream=StreamOptions\(compute_dtype=torch\.float64\))")
    off = follow(advice, model, scratch)
    with torch.no_grad():
        assert torch.equal(model(x), in_memory.double()(x))
    off.close()


def test_trainer_max_grad_norm_advice_clips_as_the_trainer_does_in_memory(scratch, tmp_path):
    """The refusal of TrainingArguments(max_grad_norm>0) says: max_grad_norm=0, grads mode and
    trainer_arguments(offload, clip_grad_norm=...). Followed, the run equals a Trainer clipping in memory."""
    transformers = pytest.importorskip("transformers")
    from deepoffload import trainer_arguments

    def build():
        torch.manual_seed(0)
        config = tiny_llama_config(transformers)
        return transformers.LlamaForCausalLM(config)

    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 12), generator=generator)]

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    def arguments(max_grad_norm):
        return transformers.TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            max_steps=3,
            max_grad_norm=max_grad_norm,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
        )

    reference = build()
    transformers.Trainer(
        reference, arguments(0.05), train_dataset=data, optimizers=(adamw(reference.parameters()), None)
    ).train()
    model = build()
    with offload_parameters(model, str(scratch), train=TrainOptions(adamw)) as off:
        with pytest.raises(ValueError, match="max_grad_norm=0.05") as refused:
            transformers.Trainer(model, arguments(0.05), train_dataset=data, **trainer_arguments(off)).train()
    assert states_equal(model.state_dict(), build().state_dict())  # refused before the first step
    message = str(refused.value)
    zero = float(advised(message, r"TrainingArguments\(max_grad_norm=(\d+)\)"))
    mode = advised(message, r'use mode="(\w+)"')
    assert re.search(r"trainer_arguments\(offload, clip_grad_norm=\.\.\.\)", message)
    with offload_parameters(model, str(scratch), train=TrainOptions(adamw, mode=mode)) as off:
        clipping = trainer_arguments(off, clip_grad_norm=0.05)
        transformers.Trainer(model, arguments(zero), train_dataset=data, **clipping).train()
        trained = model.state_dict()
    unclipped = build()
    transformers.Trainer(
        unclipped, arguments(0), train_dataset=data, optimizers=(adamw(unclipped.parameters()), None)
    ).train()
    assert states_equal(trained, reference.state_dict())
    assert not states_equal(unclipped.state_dict(), reference.state_dict())  # (the clipping changed the run)


def two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def test_load_dtype_for_a_module_in_memory_is_refused_not_ignored_and_converting_first_works(scratch):
    """LoadOptions(dtype=) sets the dtype of parameters made from meta; given a module in memory and a checkpoint it
    used to be ignored (the parameters stayed float32). It is refused; converting first, as advised, gives the dtype."""
    from deepoffload.formats import save_file

    save_file(two_linears().state_dict(), scratch / "model.safetensors")
    model = two_linears()
    load = LoadOptions(checkpoint=scratch / "model.safetensors", dtype=torch.float16)
    with pytest.raises(ValueError, match=r"LoadOptions\(dtype=torch.float16\) applies to tensors on the meta device"):
        offload_parameters(model, str(scratch / "swap"), load=load)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before anything was made
    with offload_parameters(model.to(torch.float16), str(scratch / "swap"), load=load.replace(dtype=None)):
        state = model.state_dict()
    expected = {k: v.to(torch.float16) for k, v in two_linears().state_dict().items()}
    assert states_equal(state, expected)


@pytest.mark.parametrize("built", ["meta", "memory"])
def test_converting_a_served_model_advises_offloading_it_in_that_dtype(scratch, built):
    from deepoffload.formats import save_file

    save_file(two_linears().state_dict(), scratch / "model.safetensors")
    expected = {k: v.to(torch.float16) for k, v in two_linears().state_dict().items()}

    def build():
        if built == "memory":
            return two_linears()
        with torch.device("meta"):
            return two_linears()

    served = LoadOptions(checkpoint=scratch / "model.safetensors", serve_from_checkpoint=True)
    model = build()
    with offload_parameters(model, str(scratch / "a"), load=served) as off:
        assert all(b.served is not None for b in off.blocks)
        with pytest.raises(ValueError, match="served read-only") as refused:
            model.half()
    message = str(refused.value)
    model = build()
    if built == "meta":
        dtype = advised(message, r"built on the meta device: load=LoadOptions\(\.\.\., dtype=(torch\.\w+)\)")
        load = served.replace(dtype=eval(dtype, {"torch": torch}))
    else:
        converted = advised(message, r"in memory: (model\.to\(torch\.\w+\)) first")
        model = eval(converted, {"torch": torch, "model": model})
        load = served
    with offload_parameters(model, str(scratch / "b"), load=load), torch.no_grad():
        assert states_equal(model.state_dict(), expected)
        assert model(torch.ones(1, 8, dtype=torch.float16)).dtype == torch.float16


def test_a_cache_the_recomputation_cannot_rewind_is_refused_and_a_dynamic_cache_trains(scratch):
    """A StaticCache (updated in place) passed to a streamed model's training forward is refused, as its backward
    would update it a second time; the advice, a DynamicCache or use_cache=False, trains as in memory."""
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(transformers)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with offload_parameters(model, str(scratch), train=TrainOptions(sgd, mode="grads")) as off:
        static = transformers.StaticCache(config=config, max_cache_len=16)
        with pytest.raises(ValueError, match="update that cache a second time") as refused:
            model(ids, labels=ids, past_key_values=static)
        message = str(refused.value)
        assert "Use a DynamicCache, or use_cache=False when training" in message
        assert states_equal(model.state_dict(), reference.state_dict())  # nothing stepped or changed
        off.zero_grad()
        model(ids, labels=ids, past_key_values=transformers.DynamicCache(config=config)).loss.backward()
        off.step()
        off.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        off.step()
        trained = model.state_dict()
    expected = sgd(reference.parameters())
    for cache in (transformers.DynamicCache(config=config), None):
        reference(ids, labels=ids, past_key_values=cache, use_cache=cache is not None).loss.backward()
        expected.step()
        expected.zero_grad()
    assert states_equal(trained, reference.state_dict())
