"""Parameter offload, training: several steps in both gradient modes give bit-identical losses and parameters to
in-memory training with the same optimizer (per-parameter optimizers do the same arithmetic whether they step all
parameters at once or block by block, and recomputation replays the same kernels), gradient accumulation, mixed
precision against an in-memory reference doing the same casts, and resident bytes within (prefetch + 2) blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepoffload import StreamOptions, TrainOptions
from deepoffload.swap.params import offload_parameters
from tests.support.models import ModelSize, SyntheticText, build_model

SIZE = ModelSize(vocab=64, width=32, layers=4, heads=2, context=16, batch=3)
OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_training_bit_identical_to_in_memory(scratch, mode, prefetch):
    reference, model = build_model(SIZE), build_model(SIZE)
    make = OPTIMIZERS["adam"]
    optimizer = make(reference.parameters())
    offload = offload_parameters(
        model, str(scratch), train=TrainOptions(mode=mode, optimizer=make), stream=StreamOptions(prefetch=prefetch)
    )
    block_bytes = offload.stats.block_bytes
    data, peaks = SyntheticText(SIZE), []
    try:
        for _ in range(4):
            batch = data.batch()
            loss = reference.loss(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            offload.reset_peak()
            streamed = model.loss(batch)
            streamed.backward()
            offload.step()
            offload.zero_grad()
            peaks.append(offload.stats.peak_bytes)
            assert streamed.item() == loss.item()
        stats = offload.stats
        assert max(peaks) <= (prefetch + 2) * block_bytes
        assert stats.peak_grad_bytes <= (1 if mode == "fused" else 2) * block_bytes
        assert stats.state_bytes_written > 0 and stats.bytes_written > 4 * SIZE.layers * block_bytes
    finally:
        offload.close(restore=True)
    assert params_equal(model, reference)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_other_per_parameter_optimizers_fused(scratch, name):
    reference, model = build_model(SIZE), build_model(SIZE)
    optimizer = OPTIMIZERS[name](reference.parameters())
    data = SyntheticText(SIZE)
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=OPTIMIZERS[name])) as offload:
        for _ in range(3):
            batch = data.batch()
            optimizer.zero_grad()
            reference.loss(batch).backward()
            optimizer.step()
            model.loss(batch).backward()
            offload.step()
            offload.zero_grad()
        state = offload.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_gradient_accumulation_in_grads_mode(scratch):
    reference, model = build_model(SIZE), build_model(SIZE)
    make = OPTIMIZERS["adam"]
    optimizer = make(reference.parameters())
    data = SyntheticText(SIZE)
    with offload_parameters(model, str(scratch), train=TrainOptions(mode="grads", optimizer=make)) as offload:
        for _ in range(2):
            optimizer.zero_grad()
            for _ in range(3):  # three micro-batches per step
                batch = data.batch()
                reference.loss(batch).backward()
                model.loss(batch).backward()
            optimizer.step()
            offload.step()
            offload.zero_grad()
        state = offload.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


class Mlp(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("mode, clip", [("fused", None), ("grads", None), ("grads", 0.05)])
def test_mixed_precision_matches_in_memory_with_the_same_casts(scratch, mode, clip):
    """fp32 masters on storage, bf16 compute. The reference keeps fp32 masters in memory, computes with bf16
    copies and steps the masters with the bf16 gradients cast to fp32 (clipped by their global norm if ``clip``):
    the same arithmetic, so bit-identical."""
    width, depth = 16, 3
    torch.manual_seed(0)
    masters_model = nn.Sequential(*[Mlp(width) for _ in range(depth)])
    compute = nn.Sequential(*[Mlp(width) for _ in range(depth)])
    compute.load_state_dict(masters_model.state_dict())
    model = nn.Sequential(*[Mlp(width) for _ in range(depth)])
    model.load_state_dict(masters_model.state_dict())
    compute.to(torch.bfloat16)
    make = OPTIMIZERS["adam"]
    optimizer = make(masters_model.parameters())
    offload = offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode=mode, optimizer=make),
        stream=StreamOptions(compute_dtype=torch.bfloat16),
    )
    generator = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x = torch.randn(8, width, generator=generator).to(torch.bfloat16)
            loss = compute(x).float().square().mean()
            loss.backward()
            for master, param in zip(masters_model.parameters(), compute.parameters()):
                master.grad = param.grad.float()
                param.grad = None
            expected = None if clip is None else torch.nn.utils.clip_grad_norm_(masters_model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for master, param in zip(masters_model.parameters(), compute.parameters()):
                    param.copy_(master)
            streamed = model(x).float().square().mean()
            streamed.backward()
            total = offload.step(clip_grad_norm=clip)
            offload.zero_grad()
            assert streamed.item() == loss.item()
            assert total is expected is None or (torch.equal(total, expected) and total.item() > clip)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    finally:
        offload.close(restore=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert params_equal(model, masters_model)


def test_block_called_twice_steps_once_after_its_last_backward(scratch):
    torch.manual_seed(0)
    shared, other = Mlp(8), Mlp(8)

    class Twice(nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.blocks = nn.ModuleList([a, b])

        def forward(self, x):
            return self.blocks[1](self.blocks[0](self.blocks[0](x)))

    reference = Twice(shared, other)
    model = Twice(Mlp(8), Mlp(8))
    model.load_state_dict(reference.state_dict())
    make = OPTIMIZERS["sgd"]
    optimizer = make(reference.parameters())
    x = torch.randn(4, 8)
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=make)) as offload:
        for _ in range(2):
            optimizer.zero_grad()
            reference(x).square().mean().backward()
            optimizer.step()
            model(x).square().mean().backward()
            offload.step()
        state = offload.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_input_gradients_reach_the_rest_of_the_model(scratch):
    """Blocks pass gradients to their inputs: the embedding (outside the blocks) gets the same gradient."""
    reference, model = build_model(SIZE), build_model(SIZE)
    batch = SyntheticText(SIZE).batch()
    reference.loss(batch).backward()
    with offload_parameters(model, str(scratch), train=TrainOptions(mode="grads", optimizer=OPTIMIZERS["sgd"])):
        model.loss(batch).backward()
        assert torch.equal(model.embed.weight.grad, reference.embed.weight.grad)
        assert torch.equal(model.position.grad, reference.position.grad)


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_no_optimizer_state_read_is_held_between_steps(scratch, mode):
    """The blocks' optimizer steps block by block, each block's state read with the block: its step reads nothing
    ahead for the next step (that would read a block's state just written again, and hold staging buffers through
    the next forward and backward: the memory harness's grads entries measured a block more)."""
    model = build_model(SIZE)
    offload = offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=OPTIMIZERS["adam"]))
    data = SyntheticText(SIZE)
    try:
        pipeline = offload.optimizers[0].pipeline
        for _ in range(3):
            model.loss(data.batch()).backward()
            offload.step()
            offload.zero_grad()
            assert not pipeline.prefetched
    finally:
        offload.close()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_grads_mode_reads_each_block_state_once_a_step(scratch, prefetch):
    """Grads mode reads the next blocks' state while a block steps: a block's step keeps those reads for their own
    steps, so each parameter's state is read once a step (the training stays bit-identical: test above)."""
    model = build_model(SIZE)
    offload = offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode="grads", optimizer=OPTIMIZERS["adam"]),
        stream=StreamOptions(prefetch=prefetch),
    )
    data = SyntheticText(SIZE)
    try:
        pipeline = offload.optimizers[0].pipeline
        reads: list[int] = []
        read = pipeline.read
        pipeline.read = lambda chunk: (reads.extend(map(id, chunk)), read(chunk))[1]
        for step in range(3):
            reads.clear()
            model.loss(data.batch()).backward()
            offload.step()
            offload.zero_grad()
            assert not pipeline.prefetched
            if step:  # the first step creates the state: nothing to read
                assert sorted(reads) == sorted(set(reads))
                assert len(reads) == sum(len(b.masters) for b in offload.blocks)
    finally:
        offload.close()


class _SideBranch(nn.Module):
    """A block whose ``side`` layer runs (and gets a gradient) only when ``use_side`` is set."""

    use_side = True

    def __init__(self):
        super().__init__()
        self.main, self.side = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        x = torch.tanh(self.main(x))
        return x + self.side(x) if self.use_side else x


@pytest.mark.parametrize("prefetch", [1, 2])
def test_grads_mode_steps_with_some_parameters_without_gradients_as_in_memory(scratch, prefetch):
    """Steps where a block's parameter has no gradient: the state read ahead for all of a block's parameters is
    released, neither kept nor used stale, when the block steps over fewer of them; bit-identical to in-memory Adam."""
    torch.manual_seed(0)
    reference = nn.Sequential(*(_SideBranch() for _ in range(4)))
    model = nn.Sequential(*(_SideBranch() for _ in range(4)))
    model.load_state_dict(reference.state_dict())
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    offload = offload_parameters(
        model,
        str(scratch),
        blocks=list(model),
        train=TrainOptions(mode="grads", optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2)),
        stream=StreamOptions(prefetch=prefetch),
    )
    try:
        for step in range(6):
            _SideBranch.use_side = step % 3 != 1
            x = torch.randn(4, 16)
            optimizer.zero_grad()
            reference(x).square().mean().backward()
            optimizer.step()
            model(x).square().mean().backward()
            offload.step()
            offload.zero_grad()
            assert not offload.optimizers[0].pipeline.prefetched  # none left behind
    finally:
        _SideBranch.use_side = True
        offload.close(restore=True)
    assert params_equal(model, reference)
