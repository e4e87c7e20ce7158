"""OffloadedOptimizer's read-ahead across steps (default mode): as a step ends, the state of the next step's first
chunks is being read, so that step starts stepping at once; results stay bit-identical to the plain optimizer when
the state is reset, reloaded or read between steps, parameters get no gradient, or step_in_backward is turned on."""

from __future__ import annotations

import pytest
import torch

from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer


@pytest.fixture
def config(scratch):
    return SwapConfig(folder=str(scratch), chunk_bytes=8192, buffer_count=4, pin=False)  # many chunks per step


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(6)])


def backward(model: torch.nn.Module, step: int, skip_last: bool = False) -> None:
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(step))
    layers = list(model)[:-1] if skip_last else list(model)
    torch.nn.Sequential(*layers)(x).square().mean().backward()


def counting_reads(opt: OffloadedOptimizer) -> list[int]:
    """A list that grows by one with every read the optimizer's pipeline starts itself."""
    started: list[int] = []
    read = opt.pipeline.read

    def counted(chunk):
        started.append(1)
        return read(chunk)

    opt.pipeline.read = counted  # type: ignore[method-assign]
    return started


def test_a_step_ends_with_the_next_steps_first_chunks_being_read(config):
    model = mlp()
    opt = OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01)
    try:
        backward(model, 0)
        opt.step()
        chunks = opt.pipeline.chunks([p for p in model.parameters()])
        window = config.buffer_count - 1  # what a step keeps in flight beyond the chunk stepping
        assert len(chunks) > window
        assert list(opt.pipeline.prefetched) == [tuple(map(id, c)) for c in chunks[:window]]
        opt.zero_grad()
        backward(model, 1)
        started = counting_reads(opt)
        opt.read_ahead = False  # (so that every read counted is one the step itself needed)
        opt.step()
        assert len(started) == len(chunks) - window  # the first chunks' state came from the reads started early
        assert not opt.pipeline.prefetched
    finally:
        opt.close()


def test_read_ahead_off_reads_nothing_between_steps(config):
    model = mlp()
    opt = OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01)
    opt.read_ahead = False
    try:
        for step in range(2):
            backward(model, step)
            opt.step()
            opt.zero_grad()
            assert not opt.pipeline.prefetched
    finally:
        opt.close()


@pytest.mark.parametrize("read_ahead", [True, False])
def test_identical_to_in_memory_with_changes_between_steps(config, read_ahead):
    reference, model = mlp(), mlp()
    plain = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    opt = OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=0.01, weight_decay=0.1)
    opt.read_ahead = read_ahead
    try:
        for step in range(10):
            for m, o in ((reference, plain), (model, opt)):
                if step == 3:  # the state of the first parameter reset between steps (read ahead already)
                    o.state[next(iter(m.parameters()))] = {}
                if step == 5:  # a checkpoint round trip between steps
                    o.load_state_dict(o.state_dict())
                if step == 8 and o is opt:
                    opt.step_in_backward()
                backward(m, step, skip_last=step in (4, 6))  # some steps give the last layer no gradient
                o.step()
                o.zero_grad()
        for a, b in zip(reference.parameters(), model.parameters()):
            assert torch.equal(a, b)
        saved, expected = opt.state_dict()["state"], plain.state_dict()["state"]
        assert saved.keys() == expected.keys()
        for index, values in expected.items():
            for key, value in values.items():
                assert torch.equal(saved[index][key], value), (index, key)
    finally:
        opt.close()


@pytest.mark.parametrize("read_ahead", [True, False])
def test_prefetched_reads_wait_for_their_step_and_are_never_used_stale(config, read_ahead):
    """``prefetch(params)``: a step over other parameters keeps those reads for their own step (none read again);
    a step over some of them, in other chunks, changes their state, so it releases them and the next step over all
    of them reads again: bit-identical to the plain optimizer."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(3)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = OffloadedOptimizer(torch.optim.Adam, params, config, lr=0.1)
    opt.read_ahead = read_ahead
    plain = torch.optim.Adam(reference, lr=0.1)
    started = counting_reads(opt)

    def step(which: list[int], seed: int) -> None:
        for ps, optimizer in ((params, opt), (reference, plain)):
            for i, p in enumerate(ps):
                p.grad = torch.randn(64, generator=torch.Generator().manual_seed(seed + i)) if i in which else None
            optimizer.step()

    try:
        step([0, 1, 2], 0)  # the state exists from here
        opt.prefetch(params[:2])
        before = len(started)
        step([2], 10)  # other parameters: the prefetched reads stay
        assert opt.pipeline.prefetched
        after_other = len(started)
        step([0, 1], 20)  # uses them: nothing of theirs read again (only the read-ahead for the next step, if on)
        assert len(started) == after_other + read_ahead
        opt.prefetch(params[:2])
        step([0], 30)  # changes parameter 0's state: the read holding it goes
        step([0, 1], 40)  # reads both again, as they are now
        assert before < after_other
        assert all(torch.equal(p, r) for p, r in zip(params, reference))
    finally:
        opt.close()
