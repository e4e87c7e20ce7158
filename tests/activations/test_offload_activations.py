"""``offload_activations`` gives gradients bit-identical to the same step without it: an MLP, a tiny Llama built from
its transformers config (also under bf16 autocast and with gradient checkpointing), several backward passes, a double
backward through a retained graph, non-contiguous and view saved tensors, integer and bool saved tensors, tensors
saved twice; and what it writes: parameters never, a storage saved twice once, its folder removed at exit."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from deepoffload import offload_activations

from .helpers import config, grads, plain_and_offloaded, same


def mlp(width: int = 256, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def test_mlp_gradients_bit_identical_and_its_activations_written(scratch):
    model, x = mlp(), torch.randn(512, 256)
    plain, offloaded, stats = plain_and_offloaded(model, lambda: model(x).square().mean().backward(), scratch)
    assert same(plain, offloaded)
    assert stats["written"] >= 8 and stats["bytes_written"] >= 8 * 512 * 256 * 4
    assert stats["read"] >= 1, "some saved tensors came back from the file, not from memory"
    assert os.listdir(scratch) == [], "the run folder is removed at exit"


def test_parameters_and_small_tensors_are_never_written(scratch):
    model, x = mlp(), torch.randn(512, 256)
    written: list[int] = []
    from deepoffload.activations import store as store_module

    original = store_module.ActivationStore.write

    def spy(self, tensor, version, index, copy=False):
        written.append(tensor.untyped_storage().data_ptr())
        return original(self, tensor, version, index, copy)

    store_module.ActivationStore.write = spy
    try:
        with offload_activations(str(scratch), min_bytes=0, config=config()):
            model(x).sum().backward()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert written and not params & set(written), "no parameter (nor a view of one: weight.t()) was written"
        written.clear()
        with offload_activations(str(scratch), min_bytes=1 << 30, config=config()) as off:
            model(x).sum().backward()
        assert not written and off.stats()["kept"] > 0
    finally:
        store_module.ActivationStore.write = original


def test_tensor_saved_twice_and_its_views_are_written_once(scratch):
    w = nn.Parameter(torch.randn(256, 256))

    def step():
        h = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) @ w
        a = h.sin()  # saves h
        b = h.cos()  # saves h again
        d = h[1:, 1::2] * h.t()[1:, ::2]  # saves two views of h's storage (offsets, strides)
        (a.sum() + b.sum() + d.sum()).backward()

    plain, offloaded, stats = plain_and_offloaded(nn.ParameterList([w]), step, scratch)
    assert same(plain, offloaded)
    assert stats["deduplicated"] >= 3 and stats["written"] == 2, "h's storage written once (and mm's input)"


def test_a_tensor_changed_in_place_between_two_saves_is_written_again(scratch):
    w = nn.Parameter(torch.randn(256, 256))

    def step():
        h = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) @ w
        kept = h.sin()  # saves h (this graph is never back-propagated)
        h.add_(1)  # a new version of h
        h.cos().sum().backward()  # saves the new h: sharing the first save's bytes would be wrong
        del kept

    plain, offloaded, stats = plain_and_offloaded(nn.ParameterList([w]), step, scratch)
    assert same(plain, offloaded)
    assert stats["deduplicated"] == 0 and stats["written"] == 3


@pytest.mark.parametrize("through", ["itself", "a view"])
def test_a_saved_tensor_changed_in_place_after_its_save_is_refused_at_backward_as_in_memory(scratch, through):
    """Plain autograd refuses such a backward (its gradients would not be the forward's): so does the offload,
    whether the write is done or still in flight, and whether the change went through the tensor or a view of it."""
    w = nn.Parameter(torch.randn(512, 512))

    def step():
        h = torch.randn(512, 512, generator=torch.Generator().manual_seed(1)) @ w
        y = h.sigmoid()  # saves its output y
        loss = (y * 3).sum()
        (y if through == "itself" else y[:8]).mul_(2)
        loss.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step()
    with offload_activations(str(scratch), min_bytes=0, config=config()):
        with pytest.raises(RuntimeError, match="changed in place after it was saved.*clone"):
            step()


def test_non_contiguous_views_integer_and_bool_saved_tensors(scratch):
    w = nn.Parameter(torch.randn(64, 300))
    index = torch.randint(0, 300, (64, 4096), generator=torch.Generator().manual_seed(3))

    def step():
        x = torch.randn(300, 64, generator=torch.Generator().manual_seed(2)).t()  # non-contiguous
        y = (x * w)[:, 1::3]  # a strided view: mul saves x (a view) and w
        mask = y > 0  # bool
        z = torch.where(mask, y, y * 0.5)  # where saves the bool mask
        g = torch.gather(w.repeat(1, 14), 1, index)  # gather saves the int64 index
        (z.sum() + g.square().sum()).backward()

    plain, offloaded, stats = plain_and_offloaded(nn.ParameterList([w]), step, scratch)
    assert same(plain, offloaded)
    assert stats["written"] >= 3, stats


def test_several_backward_passes_and_steps_in_one_context(scratch):
    model = mlp()
    xs = [torch.randn(256, 256, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for x in xs:
        model(x).sum().backward()  # accumulated over three micro-batches
    plain = grads(model)
    with offload_activations(str(scratch), min_bytes=0, config=config()) as off:
        for x in xs:
            model(x).sum().backward()
            assert off.stats()["stored"] == 0, "each backward frees what it stored"
    assert same(plain, grads(model))


def test_two_forwards_then_their_backwards(scratch):
    model = mlp()
    x1, x2 = torch.randn(256, 256), torch.randn(256, 256)
    (model(x1).sum() + model(x2).sum()).backward()
    plain = grads(model)
    with offload_activations(str(scratch), min_bytes=0, config=config()):
        a = model(x1).sum()
        b = model(x2).sum()
        (a + b).backward()
    assert same(plain, grads(model))


def test_retain_graph_then_double_backward(scratch):
    model = mlp()
    x = torch.randn(256, 256, requires_grad=True)

    def step():
        loss = model(x).tanh().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        (gx,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        gx.square().sum().backward()

    step()
    plain = grads(model) + [x.grad.clone()]
    x.grad = None
    with offload_activations(str(scratch), min_bytes=0, config=config()) as off:
        step()
    assert same(plain, grads(model) + [x.grad.clone()])
    assert off.stats()["read"] > off.stats()["written"] // 2, "the second backward read the stored tensors again"


def test_backward_after_the_context_exits_then_the_folder_goes(scratch):
    model, x = mlp(), torch.randn(512, 256)
    model(x).sum().backward()
    plain = grads(model)
    with offload_activations(str(scratch), min_bytes=0, config=config()) as off:
        loss = model(x).sum()
    assert os.listdir(scratch), "the graph still needs the file"
    loss.backward()
    del loss
    assert same(plain, grads(model))
    assert os.listdir(scratch) == [], "freed with the graph"
    assert off.stats()["stored"] == 0


def test_graph_dropped_without_backward_frees_everything(scratch):
    model, x = mlp(), torch.randn(512, 256)
    with offload_activations(str(scratch), min_bytes=0, config=config()) as off:
        loss = model(x).sum()
        assert off.stats()["stored"] > 0
        del loss
        assert off.stats()["stored"] == 0
    assert os.listdir(scratch) == []


def test_torch_utils_checkpoint_inside(scratch):
    from torch.utils.checkpoint import checkpoint

    blocks = nn.ModuleList(mlp(256, 2) for _ in range(3))
    x = torch.randn(256, 256, requires_grad=True)

    def step(reentrant: bool):
        h = x
        for block in blocks:
            h = checkpoint(block[:-1], h, use_reentrant=reentrant)
        h.square().sum().backward()

    for reentrant in (False, True):
        plain, offloaded, stats = plain_and_offloaded(blocks, lambda: step(reentrant), scratch)
        assert same(plain, offloaded), reentrant
        if reentrant:
            assert stats["written"] >= 2, "the reentrant checkpoint's saved inputs went to storage"


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("variant", ["fp32", "autocast_bf16", "gradient_checkpointing"])
def test_tiny_llama_from_its_transformers_config(scratch, variant):
    model = tiny_llama()
    model.train()
    if variant == "gradient_checkpointing":
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(5))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "autocast_bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    plain, offloaded, stats = plain_and_offloaded(model, step, scratch, min_bytes=16 << 10)
    assert same(plain, offloaded)
    assert stats["written"] > 0 and stats["read"] > 0, stats


def test_checksums_are_on_by_default(scratch):
    with offload_activations(str(scratch)) as off:
        pass
    assert off.config.checksum
    with offload_activations(str(scratch), checksum=False) as off:
        pass
    assert not off.config.checksum


def test_bad_arguments(scratch):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_bytes"):
            offload_activations(str(scratch), min_bytes=bad)
        with pytest.raises(ValueError, match="prefetch"):
            offload_activations(str(scratch), prefetch=bad)


def test_tensors_already_on_storage_are_not_written_again(scratch, tmp_path):
    path = tmp_path / "mapped.bin"
    torch.randn(512, 512).numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=True, size=512 * 512).view(512, 512)  # a storage mapped from a file
    w = nn.Parameter(torch.randn(512, 512))
    with offload_activations(str(scratch), min_bytes=0, config=config()) as off:
        h = (w * mapped).sin()  # mul saves mapped (kept) and w (a parameter: kept); sin saves w * mapped
        assert off.stats()["written"] == 1
        assert off.store is not None
        off.store.reap(wait=True)  # written: what the graph holds is on storage now
        back = h.grad_fn._saved_self  # read back from the file
        assert off.stats()["read"] == 1
        (back * w).sum().backward()  # saves the tensor read back: it is on storage already
        assert off.stats()["written"] == 1, "neither the mapped tensor nor the one read back was written"
        del h, back


def test_views_with_offsets_rebuilt_on_the_bytes_read_back(scratch):
    w = nn.Parameter(torch.randn(256, 256))

    def step(off=None):
        h = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) @ w
        d = h[1:, 1::2] * h.t()[1:, ::2]  # two views of one storage, with offsets and strides
        if off is not None:
            off.store.reap(wait=True)  # every write done: the backward reads them all from the file
        d.sum().backward()

    step()
    plain = grads(nn.ParameterList([w]))
    with offload_activations(str(scratch), min_bytes=0, config=config()) as off:
        step(off)
    assert same(plain, grads(nn.ParameterList([w])))
    assert off.stats()["served_from_memory"] == 0 and off.stats()["read"] == 3 and off.stats()["written"] == 2


def test_the_library_holds_at_most_the_writes_in_flight_and_the_reads_ahead(scratch):
    model, x = mlp(depth=8), torch.randn(1024, 256)  # saved tensors of 1 MiB, about 24 MiB in all
    with offload_activations(str(scratch), min_bytes=1 << 20, prefetch=2, config=config()) as off:
        model(x).sum().backward()
    stats, tensor = off.stats(), 1024 * 256 * 4
    assert stats["read"] > 0 and stats["bytes_written"] >= 16 * tensor, stats
    # one tensor being written (larger than config()'s 4 x 64 KiB), 2 read ahead and 1 being read
    assert tensor <= stats["peak_held_bytes"] <= tensor + 3 * tensor, stats
