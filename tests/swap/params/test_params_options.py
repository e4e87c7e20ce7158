"""The option objects of ``offload_parameters`` and ``from_pretrained`` (``LoadOptions``, ``TrainOptions``,
``StreamOptions``): each field checked when the object is made, with a message naming it; the keywords they replaced
refused with a ``TypeError`` naming the object and field; each option reaching the ``ParameterOffload``."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch
from torch import nn

import deepoffload
from deepoffload import ConfigError, LoadOptions, StreamOptions, TrainOptions, offload_parameters
from deepoffload.swap.params.options import MOVED

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


# (the object, its arguments, the error class, a pattern of its message): every check of every field
BAD = [
    (LoadOptions, {"checkpoint": 3}, TypeError, r"checkpoint=: expected a path"),
    (LoadOptions, {"init": 3}, TypeError, r"init=: expected a function called with each module, or state_dict"),
    (LoadOptions, {"init": [1, 2]}, TypeError, r"init=: expected a function"),
    (LoadOptions, {"dtype": torch.int8}, ValueError, r"dtype=torch.int8: expected a floating-point torch.dtype"),
    (LoadOptions, {"dtype": "bf16"}, ValueError, r"dtype='bf16': expected a floating-point torch.dtype"),
    (LoadOptions, {"strict": "yes"}, TypeError, r"strict=: expected True or False, got 'yes'"),
    (LoadOptions, {"serve_from_checkpoint": 1}, TypeError, r"serve_from_checkpoint=: expected True or False, got 1"),
    (TrainOptions, {"optimizer": "adam"}, TypeError, r"optimizer=: expected a factory taking a list of parameters"),
    (TrainOptions, {"optimizer": sgd, "mode": "sync"}, ConfigError, r"mode 'sync': expected one of fused, grads"),
    (
        TrainOptions,
        {"optimizer": sgd, "data_parallel": "yes"},
        TypeError,
        r"data_parallel=: expected True, False or a torch.distributed.ProcessGroup, got str",
    ),
    (StreamOptions, {"prefetch": -1}, ConfigError, r"prefetch=-1: expected a number of blocks, 0 or more"),
    (StreamOptions, {"prefetch": 1.5}, ConfigError, r"prefetch=1.5: expected a number of blocks"),
    (StreamOptions, {"prefetch": True}, ConfigError, r"prefetch=True: expected a number of blocks"),
    (StreamOptions, {"compute_dtype": torch.int8}, ConfigError, r"compute_dtype=torch.int8: expected a floating"),
    (StreamOptions, {"max_resident_bytes": -1}, ValueError, r"max_resident_bytes=-1: expected a number of bytes"),
    (StreamOptions, {"max_resident_bytes": "1GB"}, ValueError, r"max_resident_bytes='1GB': expected a number"),
    (StreamOptions, {"max_memory": 0}, ValueError, r"max_memory=0: expected a positive number of bytes"),
    (StreamOptions, {"max_memory": "6 parsecs"}, ValueError, r"max_memory='6 parsecs': expected bytes such as '6GB'"),
    (StreamOptions, {"max_memory": 1.5}, TypeError, r"max_memory=1.5: expected bytes \(an int\) or a string"),
    (StreamOptions, {"recompute": "no"}, ValueError, r"recompute='no': expected True or False"),
]


@pytest.mark.parametrize("cls, kwargs, error, message", BAD, ids=[f"{c.__name__}-{next(iter(k))}" for c, k, *_ in BAD])
def test_each_field_is_checked_when_the_object_is_made(cls, kwargs, error, message):
    with pytest.raises(error, match=message):
        cls(**kwargs)
    with pytest.raises(error, match=message):  # replace() checks as the constructor does
        good = cls(sgd) if cls is TrainOptions else cls()
        good.replace(**{k: v for k, v in kwargs.items() if k != "optimizer" or v == "adam"})


def test_every_field_has_a_checked_bad_value():
    """No field of the three objects is left without a case above (a new field needs its check and its case)."""
    checked = {(c, name) for c, kwargs, *_ in BAD for name in kwargs if not (name == "optimizer" and len(kwargs) > 1)}
    fields = {(cls, f.name) for cls in (LoadOptions, TrainOptions, StreamOptions) for f in dataclasses.fields(cls)}
    assert fields == checked


def test_good_values_are_kept_and_the_objects_are_frozen(tmp_path):
    load = LoadOptions(checkpoint=tmp_path, init=["head.*"], dtype=torch.bfloat16, strict=False)
    assert (load.checkpoint, load.init, load.dtype, load.strict) == (tmp_path, ["head.*"], torch.bfloat16, False)
    assert StreamOptions(max_memory="6GB", max_resident_bytes=0, prefetch=0).max_memory == "6GB"
    assert TrainOptions(sgd, mode="grads").mode == "grads"
    with pytest.raises(dataclasses.FrozenInstanceError):
        load.strict = True  # type: ignore[misc]


def test_offload_parameters_takes_at_most_ten_parameters():
    for function in (deepoffload.offload_parameters, deepoffload.from_pretrained):
        assert len(inspect.signature(function).parameters) <= 10, function


@pytest.mark.parametrize("keyword", sorted(MOVED))
def test_an_old_keyword_names_the_object_that_replaces_it(scratch, keyword):
    """Each keyword the entry points took before these objects: a TypeError naming its object and field, before
    anything is made (no swap folder, the model untouched)."""
    obj = {"train": "TrainOptions", "load": "LoadOptions", "stream": "StreamOptions"}[MOVED[keyword][0]]
    model = net()
    expected = f"{keyword}= is {MOVED[keyword][0]}=deepoffload.{obj}\\({keyword}=...\\)"
    with pytest.raises(TypeError, match=expected):
        offload_parameters(model, str(scratch / "swap"), **{keyword: None})
    if keyword == "checkpoint":  # from_pretrained refuses LoadOptions(checkpoint=): its checkpoint is its folder
        expected = r"checkpoint= is the folder given: from_pretrained\(<the checkpoint's folder>, \.\.\.\)"
    with pytest.raises(TypeError, match=expected):
        deepoffload.from_pretrained(scratch / "no-such-folder", path=str(scratch / "swap"), **{keyword: None})
    assert not os.path.exists(scratch / "swap")
    assert model[0].forward.__func__ is nn.Linear.forward  # not streamed


def test_from_pretrained_checkpoint_keyword_advice_loads_the_folder(scratch, tmp_path):
    """from_pretrained(folder, checkpoint=other): the advice (pass the checkpoint's folder itself) loads it; the
    options object the other keywords move to (LoadOptions(checkpoint=)) is refused by from_pretrained."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(config)
    saved.save_pretrained(tmp_path / "tiny")
    with pytest.raises(TypeError) as refused:
        deepoffload.from_pretrained(scratch, path=str(scratch / "swap"), checkpoint=tmp_path / "tiny")
    with pytest.raises(TypeError, match="the checkpoint is the folder given"):
        deepoffload.from_pretrained(scratch, load=LoadOptions(checkpoint=tmp_path / "tiny"))
    assert "from_pretrained(<the checkpoint's folder>, ...)" in str(refused.value)
    model, off = deepoffload.from_pretrained(tmp_path / "tiny", path=str(scratch / "swap"))
    with off, torch.no_grad():
        assert all(torch.equal(v, saved.state_dict()[k]) for k, v in model.state_dict().items())


def test_the_old_keywords_are_those_of_the_three_objects():
    assert MOVED == {
        "checkpoint": ("load", LoadOptions),
        "init": ("load", LoadOptions),
        "dtype": ("load", LoadOptions),
        "strict": ("load", LoadOptions),
        "serve_from_checkpoint": ("load", LoadOptions),
        "optimizer": ("train", TrainOptions),
        "mode": ("train", TrainOptions),
        "data_parallel": ("train", TrainOptions),
        "prefetch": ("stream", StreamOptions),
        "compute_dtype": ("stream", StreamOptions),
        "max_resident_bytes": ("stream", StreamOptions),
        "max_memory": ("stream", StreamOptions),
        "recompute": ("stream", StreamOptions),
    }


@pytest.mark.parametrize(
    "keyword, value, name",
    [("train", sgd, "TrainOptions"), ("load", "model.safetensors", "LoadOptions"), ("stream", 2, "StreamOptions")],
)
def test_an_options_keyword_takes_only_its_object(scratch, keyword, value, name):
    with pytest.raises(TypeError, match=f"{keyword}=: expected a deepoffload.{name}"):
        offload_parameters(net(), str(scratch), **{keyword: value})
    with pytest.raises(TypeError, match=f"{keyword}=: expected a deepoffload.{name}"):
        deepoffload.from_pretrained(scratch, path=str(scratch), **{keyword: value})


def test_train_and_stream_options_reach_the_offload(scratch):
    model = net()
    train = TrainOptions(sgd, mode="grads")
    stream = StreamOptions(prefetch=0, compute_dtype=torch.bfloat16, max_resident_bytes=1 << 20)
    with offload_parameters(model, str(scratch), train=train, stream=stream) as off:
        assert (off.mode, off.prefetch, off.compute_dtype) == ("grads", 0, torch.bfloat16)
        assert all(b.compute_dtype == torch.bfloat16 for b in off.blocks)
        assert off.plan.resident_bytes == 1 << 20 and off.training.block_optimizer is not None
        model(torch.randn(2, 8)).sum().backward()
        off.step()  # grads mode: the step streams the blocks through SGD
    with offload_parameters(net(), str(scratch)) as off:  # none given: inference, the defaults
        assert (off.mode, off.prefetch, off.compute_dtype, off.training.block_optimizer) == ("fused", 1, None, None)


def test_max_memory_reaches_the_plan(scratch):
    with offload_parameters(net(), str(scratch), stream=StreamOptions(prefetch=3, max_memory="64GB")) as off:
        assert off.plan.prefetch == 3 and off.plan.resident_bytes > 0  # a large limit keeps blocks in memory


def test_load_options_reach_the_offload(scratch):
    ref = net()
    torch.save(ref.state_dict(), scratch / "model.pt")
    with torch.device("meta"):
        model = net()
    load = LoadOptions(checkpoint=scratch / "model.pt", dtype=torch.float64)
    with offload_parameters(model, str(scratch / "swap"), load=load) as off, torch.no_grad():
        assert all(p.dtype == torch.float64 for p in model.parameters())
        assert torch.equal(model(torch.ones(2, 8, dtype=torch.float64)), ref.double()(torch.ones(2, 8).double()))
        assert off.load_report is not None


def test_serving_needs_a_checkpoint_given_to_offload_parameters(scratch):
    with pytest.raises(ValueError, match=r"LoadOptions\(serve_from_checkpoint=True\) needs checkpoint="):
        offload_parameters(net(), str(scratch), load=LoadOptions(serve_from_checkpoint=True))


def test_from_pretrained_takes_the_same_objects(scratch):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(scratch / "ckpt")
    with pytest.raises(TypeError, match="the checkpoint is the folder given; pass a LoadOptions without checkpoint="):
        deepoffload.from_pretrained(scratch / "ckpt", load=LoadOptions(checkpoint=scratch / "ckpt"))
    model, off = deepoffload.from_pretrained(
        scratch / "ckpt",
        path=str(scratch / "swap"),
        train=TrainOptions(sgd, mode="grads"),
        load=LoadOptions(dtype=torch.bfloat16),
        stream=StreamOptions(prefetch=0),
    )
    with off:
        assert (off.mode, off.prefetch) == ("grads", 0) and off.training.block_optimizer is not None
        assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep theirs, as transformers does
