"""Models built on the meta device, made block by block straight onto storage: fresh initialization equal to the
in-memory build with the same seed, loading from safetensors (single and sharded) and torch.save checkpoints with
key checks and dtype conversion, at most a few blocks in memory while it happens, undo on failure, and off.save()
writing a checkpoint that safetensors and transformers load back."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from deepoffload import LoadOptions, StreamOptions, TrainOptions
from deepoffload.formats import CheckpointError, CheckpointReader, save_sharded
from deepoffload.swap.params import offload_parameters
from deepoffload.swap.params.blocks.placeholders import internal
from tests.support.stepping import offload_step, reference_step

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


class Attention(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)  # resets its child out_proj's bias
        self.norm = nn.LayerNorm(width)

    def forward(self, h):
        return self.norm(h + self.attn(h, h, h, need_weights=False)[0])


class Net(nn.Module):
    def __init__(self, layers: int = 3, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(10, width)
        self.layers = nn.ModuleList(
            Attention(width) if i % 2 else nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
            for i in range(layers)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


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


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def clear_hf_flags(model) -> None:
    for t in [*model.modules(), *model.parameters(), *model.buffers()]:
        if hasattr(t, "_is_hf_initialized"):
            del t._is_hf_initialized


def test_reset_parameters_gives_the_in_memory_values(scratch):
    torch.manual_seed(0)
    reference = Net()
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(0)
    with offload_parameters(model, str(scratch)) as off, torch.no_grad():
        assert off.stats.bytes_written > 0
        assert equal_states(model.state_dict(), reference.state_dict())
        x = torch.randint(0, 10, (2, 5))
        assert torch.equal(model(x), reference(x))


def test_hf_init_weights_gives_initialize_weights_values(scratch):
    """Same seed, same values as transformers' own initialize_weights() on the model in memory. (Building the model
    in memory directly differs: each nn.Linear's constructor draws its default init before _init_weights runs,
    which a model built on meta never does.)"""
    reference = transformers.LlamaForCausalLM(llama_config())
    clear_hf_flags(reference)
    torch.manual_seed(0)
    reference.initialize_weights()
    model = meta_llama()
    torch.manual_seed(0)
    with offload_parameters(model, str(scratch), load=LoadOptions(init=model._init_weights)), torch.no_grad():
        assert equal_states(model.state_dict(), reference.state_dict())
        buffers = dict(reference.named_buffers())
        assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
        assert torch.equal(model(tokens()).logits, reference(tokens()).logits)


def write_checkpoint(kind: str, state: dict, folder):
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(folder / "model.safetensors"))
        return folder / "model.safetensors"
    if kind == "sharded":
        shards = save_sharded(state, folder / "sharded", max_shard_bytes=20_000)
        assert len(shards) > 2
        return folder / "sharded"
    torch.save(state, folder / "model.pt")
    return folder / "model.pt"


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "torch"])
def test_loads_a_checkpoint_and_trains_like_in_memory(scratch, kind):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(llama_config())
    path = write_checkpoint(kind, reference.state_dict(), scratch)
    model = meta_llama()
    off = offload_parameters(
        model,
        str(scratch / "swap"),
        train=TrainOptions(optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2)),
        load=LoadOptions(checkpoint=path, init=model._init_weights),
    )
    assert off.load_report == ([], [])
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, reference(tokens()).logits)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for i in range(2):
        ids = tokens(10 + i)
        for m, finish in ((model, offload_step(off)), (reference, reference_step(optimizer))):
            loss = m(ids, labels=ids).loss
            loss.backward()
            finish()
    assert equal_states(off.state_dict(), reference.state_dict())
    off.close()


def test_dtype_converts_what_is_loaded(scratch):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(llama_config())
    path = write_checkpoint("safetensors", reference.state_dict(), scratch)
    model = meta_llama()
    with offload_parameters(
        model, str(scratch / "swap"), load=LoadOptions(checkpoint=path, init=model._init_weights, dtype=torch.bfloat16)
    ):
        state = model.state_dict()
        assert state["model.layers.1.mlp.up_proj.weight"].dtype == torch.bfloat16
        expected = {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}
        assert equal_states(state, expected)


def test_key_problems_are_listed_and_the_model_is_left_on_meta(scratch):
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(llama_config()).state_dict()
    state.pop("model.layers.2.mlp.down_proj.weight")
    state["model.extra"] = torch.zeros(3)
    state["model.norm.weight"] = torch.ones(7)
    path = write_checkpoint("safetensors", state, scratch)
    model = meta_llama()
    with pytest.raises(CheckpointError) as raised:
        offload_parameters(model, str(scratch / "swap"), load=LoadOptions(checkpoint=path, init=model._init_weights))
    message = str(raised.value)
    for part in ("model.layers.2.mlp.down_proj.weight", "model.extra", "model.norm.weight", "strict=False"):
        assert part in message
    assert all(p.is_meta for p in model.parameters())
    # mis-shaped stays an error with strict=False
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        offload_parameters(
            model, str(scratch / "swap"), load=LoadOptions(checkpoint=path, init=model._init_weights, strict=False)
        )
    state["model.norm.weight"] = torch.ones(32)
    path = write_checkpoint("safetensors", state, scratch)
    torch.manual_seed(3)
    with offload_parameters(
        model, str(scratch / "swap"), load=LoadOptions(checkpoint=path, init=model._init_weights, strict=False)
    ) as off:
        assert off.load_report == (["model.layers.2.mlp.down_proj.weight"], ["model.extra"])
        loaded = model.state_dict()
        initialized = loaded["model.layers.2.mlp.down_proj.weight"]
        assert torch.isfinite(initialized).all() and 0.005 < initialized.std() < 0.05  # _init_weights: std 0.02
        assert torch.equal(loaded["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"])


def test_a_value_left_unset_is_refused_and_undone(scratch):
    class Scale(nn.Module):  # no reset_parameters()
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"'1\.weight'.*no reset_parameters"):
        offload_parameters(model, str(scratch))
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert not any(scratch.iterdir())  # the swap files of blocks written before are gone

    def partial(module):  # sets everything but the biases of Linear layers
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight)
        elif hasattr(module, "weight"):
            nn.init.ones_(module.weight)

    with torch.device("meta"):
        net = Net()
    with pytest.raises(ValueError, match=r"layers\.0\.0\.bias.*init= left them unset"):
        offload_parameters(net, str(scratch), load=LoadOptions(init=partial))
    assert all(p.is_meta for p in net.parameters())


def test_at_most_a_few_blocks_are_in_memory_while_made(scratch):
    with torch.device("meta"):
        model = Net(layers=12)
    made = []

    def counting_init(module):
        with internal():  # look at the storage behind streamed parameters, which user code is refused
            with_memory = sum(
                any(
                    p.numel() and p.untyped_storage().nbytes() >= p.numel() * p.element_size()
                    for p in layer.parameters()
                )
                for layer in model.layers
            )
        made.append(with_memory)
        (getattr(module, "reset_parameters", None) or module._reset_parameters)()

    with offload_parameters(model, str(scratch), load=LoadOptions(init=counting_init)) as off:
        assert off.stats.bytes_written >= sum(p.numel() * 4 for p in Net(layers=12).layers.parameters())
    assert max(made) <= 3, made  # the block being made plus up to two being written


def test_save_without_residency_loads_in_safetensors_and_transformers(scratch):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(llama_config(layers=4))
    path = write_checkpoint("safetensors", reference.state_dict(), scratch)
    model = meta_llama(layers=4)
    with offload_parameters(
        model, str(scratch / "swap"), load=LoadOptions(checkpoint=path, init=model._init_weights)
    ) as off:
        reads = off.stats.bytes_read
        off.reset_peak()
        shards = off.save(scratch / "saved", max_shard_bytes=30_000)
        assert len(shards) > 2
        assert off.stats.bytes_read - reads == off.stats.bytes_written  # each block read once (written once)
        assert off.stats.peak_bytes <= 2 * max(b.nbytes for b in off.blocks)
    index = json.loads((scratch / "saved" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(reference.state_dict())
    with CheckpointReader(scratch / "saved") as reader:
        assert equal_states(reader.read(), reference.state_dict())
    from safetensors.torch import load_file

    loaded = {}
    for shard in shards:
        loaded.update(load_file(str(shard)))
    assert equal_states(loaded, reference.state_dict())
    again = transformers.LlamaForCausalLM.from_pretrained(scratch / "saved")
    assert equal_states(again.state_dict(), reference.state_dict())


def test_resident_budget_keeps_blocks_and_reads_nothing_more(scratch):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(llama_config(layers=4)).eval()
    block_bytes = sum(p.numel() * 4 for p in reference.model.layers[0].parameters())
    ids = tokens()
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=4, do_sample=False)
    reads = {}
    for budget in (None, 2 * block_bytes + 100, 4 * block_bytes):
        model = transformers.LlamaForCausalLM(llama_config(layers=4)).eval()
        model.load_state_dict(reference.state_dict())
        with (
            offload_parameters(model, str(scratch), stream=StreamOptions(max_resident_bytes=budget)) as off,
            torch.no_grad(),
        ):
            assert off.pinned == frozenset(range({None: 0, 4 * block_bytes: 4}.get(budget, 2)))
            setup = off.stats.bytes_read
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
            reads[budget] = off.stats.bytes_read - setup
            assert off.stats.resident_bytes >= len(off.pinned) * block_bytes
    assert reads[4 * block_bytes] == 0  # every block in memory: none is read again
    assert 0 < reads[2 * block_bytes + 100] < reads[None]
    with pytest.raises(ValueError, match="max_resident_bytes"):
        offload_parameters(Net(), str(scratch), stream=StreamOptions(max_resident_bytes=-1))


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_resident_budget_trains_like_in_memory(scratch, mode):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(llama_config(layers=4))
    model = transformers.LlamaForCausalLM(llama_config(layers=4))
    model.load_state_dict(reference.state_dict())
    block_bytes = sum(p.numel() * 4 for p in reference.model.layers[0].parameters())
    off = offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode=mode, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2)),
        stream=StreamOptions(max_resident_bytes=2 * block_bytes),
    )
    assert off.pinned == frozenset({0, 1})
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for i in range(3):
        ids = tokens(20 + i)
        for m, finish in ((model, offload_step(off)), (reference, reference_step(optimizer))):
            m(ids, labels=ids).loss.backward()
            finish()
    assert equal_states(off.state_dict(), reference.state_dict())
    off.close()


def test_meta_build_with_compute_dtype_matches_the_offloaded_in_memory_model(scratch):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(llama_config())
    path = write_checkpoint("safetensors", reference.state_dict(), scratch)
    model = meta_llama()
    with (
        offload_parameters(reference, str(scratch / "a"), stream=StreamOptions(compute_dtype=torch.bfloat16)),
        offload_parameters(
            model,
            str(scratch / "b"),
            load=LoadOptions(checkpoint=path, init=model._init_weights),
            stream=StreamOptions(compute_dtype=torch.bfloat16),
        ),
        torch.no_grad(),
    ):
        assert torch.equal(model(tokens()).logits, reference(tokens()).logits)
        assert equal_states(model.state_dict(), reference.state_dict())
