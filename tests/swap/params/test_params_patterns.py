"""Parameter offload in the training and inference patterns users write beyond a plain loop: each is bit-identical
to the same code in memory, or refused at the first call with an error naming the pattern. Side effects of a
block's forward (BatchNorm running statistics, RNG draws) happen once although backward recomputes the block."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepoffload import LoadOptions, StreamOptions, TrainOptions
from deepoffload.swap.params import offload_parameters
from tests.support.stepping import offload_step, reference_step


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


class Unit(nn.Module):
    """A block with a BatchNorm (running statistics) and dropout (RNG draws)."""

    def __init__(self, width: int, dropout: float = 0.0, norm: type = nn.BatchNorm1d):
        super().__init__()
        self.linear, self.norm, self.drop = nn.Linear(width, width), norm(width), nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(torch.relu(self.norm(self.linear(x))))


class Net(nn.Module):
    def __init__(
        self,
        width: int = 16,
        depth: int = 3,
        dropout: float = 0.0,
        order: tuple[int, ...] | None = None,
        wrap: str | None = None,
        norm: type = nn.BatchNorm1d,
    ):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList([Unit(width, dropout, norm) for _ in range(depth)])
        self.head = nn.Linear(width, 1)
        self.order, self.wrap = order or tuple(range(depth)), wrap

    def forward(self, x):
        h = self.embed(x)
        for i in self.order:
            block = self.blocks[i]
            if self.wrap is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.wrap == "reentrant")
        return self.head(h)


def pair(**kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference = Net(**kwargs)
    return reference, copy.deepcopy(reference)


def batches(count: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 4, generator=generator) for _ in range(count)]


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(model: nn.Module, step, x: torch.Tensor) -> float:
    torch.manual_seed(123)  # dropout draws the same masks in both runs
    loss = model(x).square().mean()
    loss.backward()
    step()
    return loss.item()


@pytest.mark.parametrize("mode", ["fused", "grads"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dropout=0.2),
        dict(order=(0, 1, 0, 2)),
        dict(wrap="non-reentrant"),
        dict(wrap="reentrant"),
        dict(order=(0, 1, 0, 2), wrap="non-reentrant"),
        dict(order=(0, 1, 0, 2), wrap="reentrant"),
    ],
    ids=[
        "bn-dropout",
        "order-0-1-0",
        "checkpoint",
        "checkpoint-reentrant",
        "checkpoint-0-1-0",
        "checkpoint-reentrant-0-1-0",
    ],
)
def test_training_bit_identical_with_side_effects(scratch, mode, kwargs):
    """BatchNorm statistics and num_batches_tracked advance once per forward; dropout masks match; blocks called
    out of order or inside torch.utils.checkpoint step once per step (a block called twice inside a reentrant
    checkpoint is back-propagated in two nested passes: in fused mode it steps in step())."""
    reference, model = pair(**kwargs)
    optimizer = adam(reference.parameters())
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=adam)) as offload:
        for x in batches(3):
            assert train(model, offload_step(offload), x) == train(reference, reference_step(optimizer), x)
            assert not any(b.calls for b in offload.blocks)  # no call left pending from one step to the next
        assert states_equal(model.state_dict(), reference.state_dict())
        model.eval(), reference.eval()
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    if "wrap" not in kwargs:  # (torch.utils.checkpoint's recomputation updates them again, in memory too)
        assert model.blocks[0].norm.num_batches_tracked.item() == 3 * kwargs.get("order", (0,)).count(0)


@pytest.mark.parametrize("keep_outputs", [False, True])
@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_forward_with_grad_and_no_backward_does_not_stop_training(scratch, mode, keep_outputs):
    """A validation pass without torch.no_grad() (train and eval mode), its outputs dropped or kept alive during the
    next steps: training goes on exactly as in memory; backward through the stale outputs later is refused."""
    reference, model = pair()
    optimizer = adam(reference.parameters())
    data = batches(4)
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=adam)) as offload:
        kept = []
        for step, x in enumerate(data):
            outputs = []
            for m in (model, reference):
                m.eval() if step % 2 else m.train()
                outputs.append(m(x))
                m.train()
            assert torch.equal(*outputs)
            if keep_outputs:
                kept.append(outputs[0])
            del outputs
            assert train(model, offload_step(offload), x) == train(reference, reference_step(optimizer), x)
        assert states_equal(model.state_dict(), reference.state_dict())
        if keep_outputs:
            with pytest.raises(RuntimeError, match="before the block's last optimizer step|modified by an inplace"):
                kept[0].sum().backward()  # (the head outside the blocks is refused first, as in memory)


def test_eval_forward_with_grad_enabled_matches(scratch):
    reference, model = pair()
    x = batches(1)[0]
    for optimizer in (None, adam):
        r, m = copy.deepcopy(reference), copy.deepcopy(model)
        with offload_parameters(m, str(scratch), train=TrainOptions(optimizer) if optimizer else None):
            r.eval(), m.eval()
            assert torch.equal(m(x), r(x))


def test_backward_without_optimizer_is_refused(scratch):
    _, model = pair()
    with offload_parameters(model, str(scratch)):
        out = model(batches(1)[0])  # the embedding outside the blocks needs gradients: the forward still works
        with pytest.raises(RuntimeError, match="no optimizer"):
            out.sum().backward()


def test_two_backward_passes_per_step_in_fused_mode_are_refused(scratch):
    _, model = pair()
    x = batches(1)[0]
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=sgd)) as offload:
        model(x).sum().backward()
        with pytest.raises(RuntimeError, match="two backward passes"):
            model(x).sum().backward()
        offload.zero_grad()


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_frozen_blocks_after_a_trainable_layer(scratch, mode):
    """Prompt-tuning shape: only the embedding (outside the blocks) and the head train; gradients pass through the
    frozen streamed blocks."""
    reference, model = pair()
    for m in (reference, model):
        m.blocks.requires_grad_(False)
    optimizer = sgd([p for p in reference.parameters() if p.requires_grad])
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=sgd)) as offload:
        for x in batches(3):
            assert train(model, offload_step(offload), x) == train(reference, reference_step(optimizer), x)
        assert states_equal(model.state_dict(), reference.state_dict())


def test_module_state_dict_holds_the_weights(scratch):
    reference, model = pair()
    optimizer = adam(reference.parameters())
    offload = offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam))
    x = batches(1)[0]
    train(model, offload_step(offload), x), train(reference, reference_step(optimizer), x)
    state = model.state_dict()
    assert states_equal(state, reference.state_dict())
    assert offload.stats.resident_bytes == 0  # read block by block, released again
    assert [p.shape for p in model.parameters()] == [p.shape for p in reference.parameters()]  # (as stored)
    offload.close()  # the default restores: the trained weights stay in the model
    assert states_equal(model.state_dict(), reference.state_dict())
    assert torch.equal(model(x), reference(x))


def test_close_without_restore_is_explicit(scratch):
    _, model = pair()
    offload = offload_parameters(model, str(scratch))
    offload.close(restore=False)
    with pytest.raises(RuntimeError, match="closed without restore"):
        model(batches(1)[0])


@pytest.mark.parametrize(
    "convert",
    [lambda m: m.half(), lambda m: m.double(), lambda m: m.to(torch.bfloat16), lambda m: m.blocks.to(torch.float64)],
    ids=["half", "double", "to", "submodule"],
)
def test_dtype_moves_of_streamed_blocks_convert_them_as_in_memory(scratch, convert):
    reference, model = pair()
    with offload_parameters(model, str(scratch)):
        convert(model)
        convert(reference)
        assert [p.dtype for p in model.parameters()] == [p.dtype for p in reference.parameters()]
        model.to("cpu")  # moves that change nothing are fine
        assert states_equal(model.state_dict(), reference.state_dict())
        dtypes = {p.dtype for p in reference.parameters()}
        if len(dtypes) == 1:  # (the blocks alone converted: the model cannot run, in memory either)
            with torch.no_grad():
                x = batches(1)[0].to(*dtypes)
                assert torch.equal(model(x), reference(x))


class Cast(nn.Module):
    """The reference's view of a block run with compute_dtype=bf16: floating input cast to bf16, output back."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.to(torch.bfloat16)).to(x.dtype)


def test_compute_dtype_on_a_float32_model(scratch):
    """fp32 embedding and head, bf16 blocks: the block casts its floating inputs to bf16 and its outputs back,
    exactly as a reference doing the same casts."""

    reference, model = pair(norm=nn.LayerNorm)
    reference.blocks = nn.ModuleList([Cast(b.to(torch.bfloat16)) for b in reference.blocks])
    x = batches(1)[0]
    with offload_parameters(model, str(scratch), stream=StreamOptions(compute_dtype=torch.bfloat16)), torch.no_grad():
        model.eval(), reference.eval()
        out = model(x)
        assert out.dtype == torch.float32 and torch.equal(out, reference(x))


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_compute_dtype_with_batchnorm_in_a_block(scratch, mode):
    """compute_dtype=bf16 with a BatchNorm inside each block: the BatchNorm keeps its fp32 weights and running
    statistics and runs in mixed precision (bf16 input), the linear layers compute with bf16 copies of their fp32
    masters; training equals an in-memory model doing the same casts, statistics advance once per forward."""

    class CastLinear(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(x, self.weight.to(torch.bfloat16), self.bias.to(torch.bfloat16))

    reference, model = pair()
    for unit in reference.blocks:
        linear = unit.linear
        unit.linear = CastLinear(linear.in_features, linear.out_features)
        unit.linear.load_state_dict(linear.state_dict())
    reference.blocks = nn.ModuleList([Cast(b) for b in reference.blocks])
    optimizer = adam(reference.parameters())
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode=mode, optimizer=adam),
        stream=StreamOptions(compute_dtype=torch.bfloat16),
    ) as offload:
        assert model.blocks[0].norm.weight.dtype == torch.float32
        assert model.blocks[0].linear.weight.dtype == torch.bfloat16  # (its compute copy's dtype)
        for x in batches(3):
            assert train(model, offload_step(offload), x) == train(reference, reference_step(optimizer), x)
        expected = {k.replace(".inner.", "."): v for k, v in reference.state_dict().items()}
        assert states_equal(model.state_dict(), expected)
        assert model.blocks[0].norm.num_batches_tracked.item() == 3
        model.eval(), reference.eval()
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("mode", ["fused", "grads"])
@pytest.mark.parametrize("unfrozen", ["block", "rest"])
def test_unfreezing_a_parameter_frozen_at_offload_is_refused_at_its_backward(scratch, mode, unfrozen):
    """Gradual unfreezing: the optimizers were made over the parameters that required gradients at the call, so one
    unfrozen later was never stepped (in memory, an optimizer over model.parameters() steps it); freezing later
    behaves as in memory."""
    reference, model = pair()
    for m in (reference, model):
        m.blocks[0].requires_grad_(False)
        m.embed.requires_grad_(False)
    optimizer = sgd(reference.parameters())
    xs = batches(3)
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=sgd)) as offload:
        for m in (reference, model):
            m.blocks[2].requires_grad_(False)  # frozen later: no gradient, not stepped, as in memory
        for x in xs[:2]:
            assert train(model, offload_step(offload), x) == train(reference, reference_step(optimizer), x)
        assert states_equal(model.state_dict(), reference.state_dict())
        (model.blocks[0] if unfrozen == "block" else model.embed).requires_grad_(True)
        name = "blocks.0.linear.weight" if unfrozen == "block" else "embed.weight"
        with pytest.raises(RuntimeError, match=rf"parameter {name} was frozen when offload_parameters\(\) made"):
            model(xs[2]).square().mean().backward()


def strided_model() -> nn.Module:
    """Convolutions in channels_last and a linear layer with a transposed weight: parameters not row-major."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(288, 5))
    model.to(memory_format=torch.channels_last)
    model[3].weight = nn.Parameter(model[3].weight.detach().t().contiguous().t())
    return model


@pytest.mark.parametrize("mode", ["fused", "grads"])
@pytest.mark.parametrize("pinned", [False, True], ids=["streamed", "pinned"])
def test_parameters_keep_their_strides(scratch, mode, pinned):
    """Storage holds values row-major; a streamed parameter is read back in the layout it had (kernels choose by it:
    a channels_last convolution rounds differently from a row-major one), and close() gives it back so."""
    reference = strided_model()
    model = copy.deepcopy(reference)
    strides = {name: p.stride() for name, p in reference.named_parameters()}
    assert strides["0.weight"] != model[0].weight.contiguous().stride() and not model[3].weight.is_contiguous()
    x = torch.randn(2, 3, 10, 10).to(memory_format=torch.channels_last)
    optimizer = sgd(reference.parameters())
    offload = offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode=mode, optimizer=sgd),
        stream=StreamOptions(max_resident_bytes=1 << 30 if pinned else None),
    )
    try:
        for _ in range(2):
            assert train(model, offload_step(offload), x) == train(reference, reference_step(optimizer), x)
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    finally:
        offload.close()
    assert {name: p.stride() for name, p in model.named_parameters()} == strides
    assert states_equal(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("mode", ["fused", "grads"])
@pytest.mark.parametrize("serve", [False, True], ids=["loaded", "served"])
def test_a_model_built_on_meta_keeps_its_strides_when_loaded(scratch, mode, serve):
    """A channels_last model built on meta and loaded from a checkpoint gets its values in the layout it was given
    (as to_empty makes them): the same bits as the model in memory, in training too, and close() gives them back so;
    the max_memory plan counts their layout copies."""
    from safetensors.torch import save_file

    reference = strided_model()
    strides = {name: p.stride() for name, p in reference.named_parameters()}
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(scratch / "model.safetensors"))
    with torch.device("meta"):
        model = strided_model()
    x = torch.randn(2, 3, 10, 10).to(memory_format=torch.channels_last)
    offload = offload_parameters(
        model,
        str(scratch / "swap"),
        train=None if serve else TrainOptions(mode=mode, optimizer=sgd),
        load=LoadOptions(checkpoint=str(scratch / "model.safetensors"), serve_from_checkpoint=serve),
        stream=StreamOptions(max_memory="64GB", max_resident_bytes=0),
    )
    try:
        assert offload.plan.layout_bytes == 288 * 5 * 4  # the transposed linear weight, the largest
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        if not serve:
            optimizer = sgd(reference.parameters())
            for _ in range(2):
                assert train(model, offload_step(offload), x) == train(reference, reference_step(optimizer), x)
    finally:
        offload.close()
    assert {name: p.stride() for name, p in model.named_parameters()} == strides
    assert states_equal(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("mode", ["fused", "grads"])
@pytest.mark.parametrize("listed", [False, True], ids=["default-blocks", "blocks="])
def test_a_module_placed_twice_is_one_block_run_twice(scratch, listed, mode):
    """nn.Sequential(layer, other, layer): both places are the same block (not a parameter outside the blocks);
    training, state_dict, load_state_dict and close() match memory."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    reference = nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 4), layer)
    model = copy.deepcopy(reference)
    assert model[0] is model[3]
    optimizer = adam(reference.parameters())
    blocks = [model[0], model[2], model[3]] if listed else None
    with offload_parameters(
        model, str(scratch), blocks=blocks, train=TrainOptions(mode=mode, optimizer=adam)
    ) as offload:
        assert [b.prefix for b in offload.blocks] == ["0", "2"]
        for x in batches(3):
            assert train(model, offload_step(offload), x) == train(reference, reference_step(optimizer), x)
        assert states_equal(model.state_dict(), reference.state_dict())
        new = {key: torch.randn_like(value) for key, value in reference.state_dict().items()}
        new["3.weight"], new["3.bias"] = new["0.weight"], new["0.bias"]
        model.load_state_dict(new), reference.load_state_dict(new)
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    assert model[0] is model[3] and states_equal(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("listed", [False, True], ids=["default-blocks", "blocks="])
def test_a_module_placed_twice_accumulates_over_micro_batches_and_steps_once(scratch, listed):
    """Grads mode, two micro-batches per step: the block run twice per forward gets both places' gradients of both
    micro-batches and Adam steps it once per step (its step count equals memory's)."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    reference = nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 4), layer)
    model = copy.deepcopy(reference)
    optimizer = adam(reference.parameters())
    blocks = [model[0], model[2], model[3]] if listed else None
    xs = batches(6)
    with offload_parameters(
        model, str(scratch), blocks=blocks, train=TrainOptions(mode="grads", optimizer=adam)
    ) as offload:
        for i in range(0, 6, 2):
            for x in xs[i : i + 2]:
                expected = reference(x).square().mean()
                expected.backward()
                loss = model(x).square().mean()
                loss.backward()
                assert loss.item() == expected.item()
            offload_step(offload)()
            reference_step(optimizer)()
        assert states_equal(model.state_dict(), reference.state_dict())
        steps = [s["step"] for s in offload.optimizers[0].state_dict()["state"].values()]
        assert steps and all(int(s) == 3 for s in steps)
