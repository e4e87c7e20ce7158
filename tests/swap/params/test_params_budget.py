"""Resident budget in training: pinned blocks step in memory, so with the whole model in budget training reads and
writes no parameter bytes after setup, and with part of it the pinned blocks' bytes never move; losses, parameters,
state_dict(), off.save() and close() equal in-memory training in every mode (fused, grads, grads with clipping,
compute_dtype); lowering the budget writes the current values first, and a failed write keeps them in memory."""

from __future__ import annotations

import errno

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from deepoffload import StreamOptions, TrainOptions
from deepoffload.swap.params import offload_parameters
from deepoffload.swap.params.blocks.residency import Residency
from tests.support.models import ModelSize, SyntheticText, build_model

SIZE = ModelSize(vocab=64, width=32, layers=4, heads=2, context=16, batch=3)
STEPS = 3


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def block_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks.layers[0].parameters())


class ParameterTraffic:
    """Which blocks' parameter groups the offload reads and writes, and apart from those which blocks' gradient
    groups (grads mode)."""

    def __init__(self, off):
        self.reads: list[str] = []
        self.written: list[str] = []
        self.grad_reads: list[str] = []
        self.grads_written: list[str] = []
        self.bytes_read = self.bytes_written = self.grad_bytes_read = self.grad_bytes_written = 0
        swapper = off.store.swapper
        swap_in, swap_out = swapper.swap_in, swapper.swap_out

        def counted_in(groups, *args, **kwargs):
            groups = list(groups)
            for group in groups:
                if group.startswith("block"):
                    self.reads.append(group)
                    self.bytes_read += swapper.stored_bytes(group)
                elif group.startswith("grad"):
                    self.grad_reads.append(group)
                    self.grad_bytes_read += swapper.stored_bytes(group)
            return swap_in(groups, *args, **kwargs)

        def counted_out(groups, *args, **kwargs):
            for group, tensors in groups.items():
                written = sum(t.numel() * t.element_size() for t in tensors.values())
                if group.startswith("block"):
                    self.written.append(group)
                    self.bytes_written += written
                elif group.startswith("grad"):
                    self.grads_written.append(group)
                    self.grad_bytes_written += written
            return swap_out(groups, *args, **kwargs)

        swapper.swap_in, swapper.swap_out = counted_in, counted_out


def train_in_memory(steps: int = STEPS, clip: float | None = None) -> tuple[list[float], nn.Module]:
    model, data = build_model(SIZE), SyntheticText(SIZE)
    optimizer = adam(model.parameters())
    losses = []
    for _ in range(steps):
        loss = model.loss(data.batch())
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def train_streamed(off, model, data, steps: int, clip: float | None = None) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model.loss(data.batch())
        loss.backward()
        off.step(clip_grad_norm=clip)
        off.zero_grad()
        losses.append(loss.item())
    return losses


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "mode, clip, compute_dtype",
    [
        ("fused", None, None),
        ("grads", None, None),
        ("grads", 0.05, None),
        ("fused", None, torch.bfloat16),
        ("grads", None, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("share", ["whole", "half"])
def test_budget_training_equals_in_memory_and_pinned_blocks_never_move(scratch, mode, clip, compute_dtype, share):
    # the reference: in memory for fp32; for compute_dtype the streamed model without budget (whose equality to an
    # in-memory model doing the same casts is test_params_training's)
    if compute_dtype is None:
        expected_losses, reference = train_in_memory(clip=clip)
        expected_state = reference.state_dict()
    else:
        model = build_model(SIZE)
        with offload_parameters(
            model,
            str(scratch / "ref"),
            train=TrainOptions(mode=mode, optimizer=adam),
            stream=StreamOptions(compute_dtype=compute_dtype),
        ) as off:
            expected_losses = train_streamed(off, model, SyntheticText(SIZE), STEPS, clip)
            expected_state = off.state_dict()
    model = build_model(SIZE)
    per_block = block_bytes(model) + (block_bytes(model) // 2 if compute_dtype is not None else 0)
    budget = SIZE.layers * per_block if share == "whole" else SIZE.layers // 2 * per_block
    off = offload_parameters(
        model,
        str(scratch / "run"),
        train=TrainOptions(mode=mode, optimizer=adam),
        stream=StreamOptions(compute_dtype=compute_dtype, max_resident_bytes=budget),
    )
    try:
        pinned = set(range(SIZE.layers if share == "whole" else SIZE.layers // 2))
        assert off.pinned == pinned
        setup_read, setup_written = off.stats.bytes_read, off.stats.bytes_written
        traffic = ParameterTraffic(off)
        losses = train_streamed(off, model, SyntheticText(SIZE), STEPS, clip)
        assert losses == expected_losses
        assert off.pinned == pinned
        moved = set(traffic.reads) | set(traffic.written)
        assert not moved & {f"block{i}" for i in pinned}, moved
        grads_moved = set(traffic.grad_reads) | set(traffic.grads_written)  # pinned blocks' gradients stay in memory
        assert not grads_moved & {f"grad{i}" for i in pinned}, grads_moved
        if share == "whole":  # no parameter or gradient IO at all
            assert traffic.bytes_read == traffic.bytes_written == traffic.grad_bytes_written == 0
            assert (off.stats.bytes_read, off.stats.bytes_written) == (setup_read, setup_written)
        else:
            streamed = set(range(SIZE.layers)) - pinned
            assert set(traffic.reads) == set(traffic.written) == {f"block{i}" for i in streamed}
            assert set(traffic.grads_written) == ({f"grad{i}" for i in streamed} if mode == "grads" else set())
        assert states_equal(off.state_dict(), expected_state)
        assert states_equal(model.state_dict(), expected_state)
        shards = off.save(scratch / "saved")
        saved = {k: v for shard in shards for k, v in load_file(shard).items()}
        assert states_equal(saved, {k: v for k, v in expected_state.items() if k in saved})
        assert len(saved) >= len(expected_state) - 1  # at most a tied weight written once
        assert traffic.bytes_written == 0 or share == "half"
        off.close(restore=True)
    finally:
        off.close()
    assert states_equal(model.state_dict(), expected_state)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_block_called_twice_with_budget_steps_once_like_in_memory(scratch):
    torch.manual_seed(0)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

        def forward(self, x):
            return self.blocks[1](self.blocks[0](self.blocks[0](x)))

    reference, model = Twice(), Twice()
    model.load_state_dict(reference.state_dict())
    optimizer = adam(reference.parameters())
    x = torch.randn(4, 8)
    with offload_parameters(
        model, str(scratch), train=TrainOptions(optimizer=adam), stream=StreamOptions(max_resident_bytes=1 << 20)
    ) as off:
        traffic = ParameterTraffic(off)
        for _ in range(3):
            reference(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            model(x).square().mean().backward()
            off.step()
            off.zero_grad()
        assert traffic.bytes_read == traffic.bytes_written == 0
        assert states_equal(off.state_dict(), reference.state_dict())


def test_lowering_the_budget_writes_the_stepped_values_first(scratch):
    expected_losses, reference = train_in_memory(steps=4)
    model, data = build_model(SIZE), SyntheticText(SIZE)
    whole = SIZE.layers * block_bytes(model)
    with offload_parameters(
        model, str(scratch), train=TrainOptions(optimizer=adam), stream=StreamOptions(max_resident_bytes=whole)
    ) as off:
        traffic = ParameterTraffic(off)
        losses = train_streamed(off, model, data, 2)
        assert traffic.bytes_written == 0
        off.set_max_resident_bytes(whole // 2)  # the last two blocks leave memory: written with their new values
        assert off.pinned == {0, 1} and sorted(traffic.written) == ["block2", "block3"]
        assert [b.state for b in off.blocks[2:]] == [Residency.ON_STORAGE] * 2
        losses += train_streamed(off, model, data, 1)  # blocks 2 and 3 are read back from storage
        assert {"block2", "block3"} <= set(traffic.reads) and not {"block0", "block1"} & set(traffic.reads)
        off.set_max_resident_bytes(whole)  # and pinned again
        assert off.pinned == {0, 1, 2, 3}
        losses += train_streamed(off, model, data, 1)
        assert losses == expected_losses
        assert states_equal(off.state_dict(), reference.state_dict())
        with pytest.raises(ValueError, match="max_resident_bytes"):
            off.set_max_resident_bytes(-1)


def test_failed_write_when_unpinning_keeps_the_values_in_memory(scratch):
    expected_losses, reference = train_in_memory(steps=3)
    model, data = build_model(SIZE), SyntheticText(SIZE)
    whole = SIZE.layers * block_bytes(model)
    with offload_parameters(
        model, str(scratch), train=TrainOptions(optimizer=adam), stream=StreamOptions(max_resident_bytes=whole)
    ) as off:
        losses = train_streamed(off, model, data, 2)
        swap_out = off.store.swapper.swap_out

        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", str(scratch))

        off.store.swapper.swap_out = no_space
        with pytest.raises(OSError, match="No space"):
            off.set_max_resident_bytes(0)
        assert off.blocks[0].state is Residency.PINNED  # its stepped values exist only in memory: still there
        off.store.swapper.swap_out = swap_out
        off.set_max_resident_bytes(0)
        assert off.pinned == frozenset()
        losses += train_streamed(off, model, data, 1)
        assert losses == expected_losses
        assert states_equal(off.state_dict(), reference.state_dict())


def test_close_without_restore_after_pinned_steps(scratch):
    model, data = build_model(SIZE), SyntheticText(SIZE)
    off = offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(optimizer=adam),
        stream=StreamOptions(max_resident_bytes=SIZE.layers * block_bytes(model)),
    )
    train_streamed(off, model, data, 1)
    off.close(restore=False)
    with pytest.raises(RuntimeError, match="closed"):
        model.loss(data.batch())


class Pair(nn.Module):
    """Two linear layers, the second run only when asked: its parameters get gradients in some backward passes of a
    step and not in others."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x, both: bool):
        x = torch.tanh(self.a(x))
        return torch.tanh(self.b(x)) if both else x


class TwoPaths(nn.Module):
    def __init__(self, blocks: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Pair() for _ in range(blocks))

    def forward(self, x, both: bool):
        for block in self.blocks:
            x = block(x, both)
        return x.square().mean()


@pytest.mark.parametrize("share, repin", [("none", False), ("half", False), ("whole", False), ("none", True)])
def test_gradient_accumulation_with_budget_equals_in_memory(scratch, share, repin):
    """grads mode, two backward passes per step, the second without the ``b`` layers: the gradients of pinned
    blocks are added in memory, the others' on storage (a gradient without a new one in the second pass is kept),
    and a block pinned between the two passes takes its stored gradients into memory (``repin``)."""
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    reference = TwoPaths()
    optimizer = adam(reference.parameters())
    for k in range(0, len(xs), 2):
        reference(xs[k], both=True).backward()
        reference(xs[k + 1], both=False).backward()
        optimizer.step()
        optimizer.zero_grad()
    model = TwoPaths()
    per_block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    budget = {"none": 0, "half": 2 * per_block, "whole": 4 * per_block}[share]
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode="grads", optimizer=adam),
        stream=StreamOptions(max_resident_bytes=budget),
    ) as off:
        traffic = ParameterTraffic(off)
        pinned = {f"grad{b.index}" for b in off.blocks if b.state is Residency.PINNED}
        for k in range(0, len(xs), 2):
            model(xs[k], both=True).backward()
            if repin:
                off.set_max_resident_bytes(4 * per_block if k == 2 else 0)
            model(xs[k + 1], both=False).backward()
            off.step()
            off.zero_grad()
        assert states_equal(off.state_dict(), reference.state_dict())
        assert not pinned & (set(traffic.grad_reads) | set(traffic.grads_written))
        if share == "whole":
            assert traffic.grad_bytes_read == traffic.grad_bytes_written == 0
        if repin:  # step 1 writes block 0's gradients twice; step 2 once (before it is pinned, then read once into
            # memory); step 3 once (pinned in its first pass, unpinned before its second, which adds to those kept)
            assert traffic.grads_written.count("grad0") == 2 + 1 + 1
            # reads: step 1 in its second pass and in step(); step 2 once into memory; step 3 in step()
            assert traffic.grad_reads.count("grad0") == 2 + 1 + 1


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_pinned_blocks_refuse_grad_reads_until_step(scratch, mode):
    """With every block pinned, a block parameter's p.grad between backward and step() raises, as a streamed one's
    does (it would read None, and clip_grad_norm_(model.parameters()) would clip by the other parameters' norm
    alone); the blocks still compute (an eval pass, a second backward in grads mode), and after step() p.grad reads
    None again and the parameters are plain."""
    model, data = build_model(SIZE), SyntheticText(SIZE)
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(mode=mode, optimizer=adam),
        stream=StreamOptions(max_resident_bytes=1 << 30),
    ) as off:
        assert off.pinned == set(range(SIZE.layers))
        param = next(model.blocks.parameters())
        model.loss(data.batch()).backward()
        with pytest.raises(RuntimeError, match="until off.step"):
            _ = param.grad
        with pytest.raises(RuntimeError, match="until off.step"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with torch.no_grad():
            model.loss(data.batch())
        with pytest.raises(RuntimeError, match="until off.step"):
            _ = param.grad
        if mode == "grads":
            model.loss(data.batch()).backward()
        off.step()
        assert param.grad is None and type(param) is nn.Parameter
        off.zero_grad()
        model.zero_grad()
        model.loss(data.batch()).backward()
    assert param.grad is None and type(param) is nn.Parameter  # closed: nothing refused


@pytest.mark.parametrize("then", ["state_dict", "forward", "step"])
@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_loading_into_a_pinned_compute_copy_sets_its_masters(scratch, mode, then):
    # a pinned block with compute_dtype= computes with bf16 copies of fp32 masters: load_state_dict wrote the copies,
    # which the masters cannot take (then refused at the next use); the block's load hook sets the masters (fp32,
    # exact) and casts the copies again
    model, data = build_model(SIZE), SyntheticText(SIZE)
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(optimizer=adam, mode=mode),
        stream=StreamOptions(compute_dtype=torch.bfloat16, max_resident_bytes=10 * SIZE.layers * block_bytes(model)),
    ) as off:
        assert off.pinned == {0, 1, 2, 3}
        if then == "step":
            model.loss(data.batch()).backward()
        before = off.state_dict()
        new = {k: v + 1 if v.is_floating_point() else v for k, v in before.items()}
        model.load_state_dict(new)
        if then == "forward":
            model.loss(data.batch())
        elif then == "step":
            off.step()
        if then != "step":
            assert states_equal(off.state_dict(), new)
        layer = model.blocks.layers[0]
        master = off.blocks[0].masters[0]
        assert torch.equal(next(layer.parameters()), master.detach().to(torch.bfloat16))


def test_ctrl_c_while_unpinning_takes_effect_once_the_blocks_are_consistent(scratch, monkeypatch):
    # SIGINT between a block's write start and its state change left it marked pinned with placeholder parameters
    # and an untracked write: state_dict() and close() failed after it. Now it is raised when the call is done.
    import signal

    from deepoffload.swap.params.blocks.residency import Block

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    expected_losses, reference = train_in_memory(steps=3)
    model, data = build_model(SIZE), SyntheticText(SIZE)
    whole = SIZE.layers * block_bytes(model)
    with offload_parameters(
        model, str(scratch), train=TrainOptions(optimizer=adam), stream=StreamOptions(max_resident_bytes=whole)
    ) as off:
        losses = train_streamed(off, model, data, 2)
        clear_data, calls = Block.clear_data, []

        def interrupted(self):
            clear_data(self)
            calls.append(self.index)
            if len(calls) == 1:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C right there

        monkeypatch.setattr(Block, "clear_data", interrupted)
        with pytest.raises(KeyboardInterrupt):
            off.set_max_resident_bytes(0)
        monkeypatch.setattr(Block, "clear_data", clear_data)
        assert calls == [0, 1, 2, 3] and off.pinned == frozenset()
        assert [b.state for b in off.blocks] == [Residency.ON_STORAGE] * 4
        losses += train_streamed(off, model, data, 1)
        assert losses == expected_losses
        assert states_equal(off.state_dict(), reference.state_dict())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_write_wait_interrupted_by_a_signal_handler_is_collected_by_the_next_wait(scratch):
    # a handler's exception (SystemExit from a SIGTERM handler) inside the write's wait dropped the write but left
    # the block WRITING: every later wait failed with AttributeError
    expected_losses, reference = train_in_memory(steps=3)
    model, data = build_model(SIZE), SyntheticText(SIZE)
    with offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(optimizer=adam),
        stream=StreamOptions(max_resident_bytes=SIZE.layers * block_bytes(model)),
    ) as off:
        losses = train_streamed(off, model, data, 2)
        block = off.blocks[0]
        off.store.write_back(block)  # as unpinning starts it
        write = block.write
        wait = write.wait

        def interrupted():
            write.wait = wait
            raise SystemExit("terminated")

        write.wait = interrupted
        with pytest.raises(SystemExit):
            off.store.wait_write(block)
        assert block.state is Residency.WRITING and block.write is write
        off.flush()
        assert block.state is Residency.ON_STORAGE
        losses += train_streamed(off, model, data, 1)
        assert losses == expected_losses
        assert states_equal(off.state_dict(), reference.state_dict())
