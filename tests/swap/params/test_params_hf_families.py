"""``deepoffload.from_pretrained`` loads what transformers' own ``from_pretrained`` loads: tiny models built from
configs, saved with ``save_pretrained`` and loaded both ways, hold the same state and give the same output. The
fast subset covers the layouts transformers converts when loading (GPT-NeoX's ``embed_out``, Mixtral's and
Qwen2-MoE's per-expert weights, a base model's folder under a head's ``base_model_prefix``) and BERT's integer
buffers; the slow test walks every class of ``AutoModelForCausalLM``'s mapping (about 5 minutes here): each equal,
refused with the message in ``REFUSED``, or skipped with the reason it cannot be built tiny."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.support.hf_families import CannotBuild, compare  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

FAST = ["llama", "gpt_neox", "bert", "mixtral", "qwen2_moe", "gpt_bigcode"]  # (GPT-BigCode: a boolean buffer)


@pytest.mark.parametrize("model_type", FAST)
def test_from_pretrained_equals_transformers_load(scratch, model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    differ, compared = compare(model_class, transformers.CONFIG_MAPPING[model_type], scratch)
    assert differ == [] and compared


def test_a_block_buffer_its_ancestor_initializes_is_set(scratch):
    """Falcon-H1's top model copies mup_vector (a non-persistent buffer) into each layer's mixer in _init_weights:
    computed after the walk by the ancestors' initializer, as transformers' initialize_weights() computes it."""
    differ, compared = compare(transformers.FalconH1ForCausalLM, transformers.FalconH1Config, scratch)
    assert differ == [] and compared


def test_bert_model_loads_with_its_integer_buffers(scratch):
    differ, compared = compare(transformers.BertModel, transformers.BertConfig, scratch)
    assert differ == [] and compared


# refused clearly, with the part of the message that names the pattern: layers sharing one module (Zamba's shared
# transformer; offload_parameters names blocks= as the way out), and RWKV, whose eval forward rescales the blocks'
# weights in place (div_), which streamed parameters refuse
REFUSED = {
    "zamba": "choose blocks= without them",
    "zamba2": "choose blocks= without them",
    "rwkv": "div_ on it would change values that live on storage",
}


def _causal_lm_classes():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


@pytest.mark.slow
@pytest.mark.parametrize("model_type, class_name", _causal_lm_classes())
def test_walk_causal_lm_classes(scratch, model_type, class_name):
    try:
        model_class, config_class = getattr(transformers, class_name), transformers.CONFIG_MAPPING[model_type]
    except (AttributeError, KeyError, ImportError) as e:
        pytest.skip(f"{class_name}: not importable from this transformers ({type(e).__name__}: {e})")
    try:
        differ, _ = compare(model_class, config_class, scratch)
    except CannotBuild as e:
        pytest.skip(str(e))
    except (ValueError, RuntimeError) as e:
        if model_type not in REFUSED:
            raise
        assert REFUSED[model_type] in str(e)  # refused at once, naming what to do
        return
    assert differ == []


# -- refusals and the advice they give ----------------------------------------------------------------------------
def _bert(model_class, scratch, name: str):
    import contextlib
    import io

    from tests.support.hf_families import build

    with contextlib.redirect_stdout(io.StringIO()):
        build(model_class, transformers.BertConfig).save_pretrained(scratch / name)
    return scratch / name


def _follow(message: str) -> dict:
    """The arguments a refusal's message tells the user to pass (every ``name=value`` it suggests)."""
    import ast
    import re

    advice = {}
    if "strict=False" in message:
        advice["strict"] = False
    found = re.search(r"init=(\[[^\]]*\])", message)
    if found:
        advice["init"] = ast.literal_eval(found.group(1))
    assert advice, f"the refusal suggests nothing to pass: {message}"
    return advice


def _load_following_advice(folder, model_class, scratch, **options):
    """``deepoffload.from_pretrained``, called again with what each refusal suggests until it loads."""
    import deepoffload
    from deepoffload.errors import CheckpointError

    for attempt in range(3):
        try:
            return deepoffload.from_pretrained(
                folder,
                model_class,
                path=str(scratch / f"swap{attempt}"),
                load=deepoffload.LoadOptions(**options),
                stream=deepoffload.StreamOptions(prefetch=0),
            )
        except CheckpointError as e:
            options.update(_follow(str(e)))
    pytest.fail(f"still refused after following the advice three times: {options}")


@pytest.mark.parametrize(
    "saved, loaded",
    [
        ("BertModel", "BertForSequenceClassification"),  # missing head (strict, then strict=False + init=)
        ("BertForMaskedLM", "BertModel"),  # unexpected head names under the base model's prefix
        ("BertForPreTraining", "BertForSequenceClassification"),  # both
        ("BertModel", "BertForPreTraining"),  # seven missing: the advice names their modules' patterns
    ],
)
def test_every_refusal_advice_gives_transformers_values(scratch, saved, loaded):
    import deepoffload
    from deepoffload.errors import CheckpointError

    folder = _bert(getattr(transformers, saved), scratch, "ckpt")
    model_class = getattr(transformers, loaded)
    with pytest.raises(CheckpointError):
        deepoffload.from_pretrained(folder, model_class, path=str(scratch / "refused"))
    model, off = _load_following_advice(folder, model_class, scratch)
    reference = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    missing = set(off.load_report.missing)
    with off, torch.no_grad():
        state, expected = model.state_dict(), reference.state_dict()
        assert state.keys() == expected.keys()
        assert [n for n in expected if n not in missing and not torch.equal(state[n], expected[n])] == []
        for name in missing:  # initialized as transformers initializes them: same rule, own random draws
            if expected[name].unique().numel() == 1:  # a constant (zero bias, LayerNorm weight one)
                assert torch.equal(state[name], expected[name])
            else:
                assert torch.isfinite(state[name]).all() and 0.01 < state[name].std() < 0.03  # normal, std 0.02
        if not missing:
            ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(1))
            assert torch.equal(model(input_ids=ids)[0], reference(input_ids=ids)[0])


def test_strict_false_never_leaves_a_missing_parameter_initialized_unasked(scratch):
    """The old advice (strict=False) gave a randomly initialized head without a word: now missing parameters need
    init= naming them (or patterns), and any other missing one is still refused."""
    import deepoffload
    from deepoffload.errors import CheckpointError

    folder = _bert(transformers.BertModel, scratch, "ckpt")
    model_class = transformers.BertForSequenceClassification
    with pytest.raises(CheckpointError, match=r"init=\['classifier.bias', 'classifier.weight'\]"):
        deepoffload.from_pretrained(
            folder, model_class, path=str(scratch / "a"), load=deepoffload.LoadOptions(strict=False)
        )
    with pytest.raises(CheckpointError, match=r"classifier.weight"):
        deepoffload.from_pretrained(
            folder, model_class, path=str(scratch / "b"), load=deepoffload.LoadOptions(strict=False, init=["*.bias"])
        )
    model, off = deepoffload.from_pretrained(
        folder, model_class, path=str(scratch / "c"), load=deepoffload.LoadOptions(strict=False, init="classifier.*")
    )
    with off:
        assert sorted(off.load_report.missing) == ["classifier.bias", "classifier.weight"]


def test_dtype_keeps_what_transformers_keeps_in_float32(scratch):
    """from_pretrained(dtype=torch.float16) of T5 keeps its feed-forward ``wo`` in float32 (the model's
    _keep_in_fp32_modules, by transformers' own dtype plan), as transformers' from_pretrained does."""
    import contextlib
    import io

    import deepoffload
    from tests.support.hf_families import build

    with contextlib.redirect_stdout(io.StringIO()):
        build(transformers.T5ForConditionalGeneration, transformers.T5Config).save_pretrained(scratch / "ckpt")
    expected = transformers.T5ForConditionalGeneration.from_pretrained(scratch / "ckpt", dtype=torch.float16)
    model, off = deepoffload.from_pretrained(
        scratch / "ckpt", path=str(scratch / "swap"), load=deepoffload.LoadOptions(dtype=torch.float16)
    )
    with off:
        state, reference = model.state_dict(), expected.state_dict()
        assert {n: t.dtype for n, t in state.items()} == {n: t.dtype for n, t in reference.items()}
        assert any(t.dtype == torch.float32 for t in reference.values())  # (the case is exercised)
        assert [n for n in reference if not torch.equal(state[n], reference[n])] == []
