"""``OffloadedOptimizer.compute_threads``: torch's intra-op threads while a step runs, restored after; elementwise
optimizers give the same bits as the in-memory optimizer run with torch's own thread count."""

from __future__ import annotations

import pytest
import torch

from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer

NUMEL = 300_000  # above torch's parallel grain size, so the in-memory step really splits across threads


def make_params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(NUMEL, generator=generator)) for _ in range(3)]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(NUMEL, generator=generator)


@pytest.fixture
def config(scratch):
    return SwapConfig(folder=str(scratch), chunk_bytes=NUMEL * 8, buffer_count=3)  # one parameter per chunk


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_one_thread_matches_in_memory_step_on_all_threads(optimizer, config):
    threads = torch.get_num_threads()
    reference, params = make_params(0), make_params(0)
    plain = optimizer(reference, lr=1e-2)
    seen: list[int] = []
    with OffloadedOptimizer(optimizer, params, config, lr=1e-2) as offloaded:
        offloaded.compute_threads = 1
        inner_step = offloaded.pipeline.inner_step  # the wrapped optimizer's step, once per chunk

        def counted() -> None:
            seen.append(torch.get_num_threads())
            inner_step()

        offloaded.pipeline.inner_step = counted
        for step in range(5):
            set_grads(reference, step)
            set_grads(params, step)
            plain.step()
            offloaded.step()
            assert torch.get_num_threads() == threads, "restored after the step"
    assert seen and set(seen) == {1}, "every chunk stepped with the chosen thread count"
    for a, b in zip(reference, params):
        assert torch.equal(a, b)


def test_none_leaves_torch_setting_alone(config):
    threads = torch.get_num_threads()
    seen: list[int] = []
    with OffloadedOptimizer(torch.optim.SGD, make_params(1), config, lr=0.1, momentum=0.9) as offloaded:
        assert offloaded.compute_threads is None
        inner_step = offloaded.pipeline.inner_step  # the wrapped optimizer's step, once per chunk

        def counted() -> None:
            seen.append(torch.get_num_threads())
            inner_step()

        offloaded.pipeline.inner_step = counted
        set_grads(offloaded.pipeline.params(), 0)
        offloaded.step()
    assert set(seen) == {threads}


def test_restored_when_the_step_fails(config):
    threads = torch.get_num_threads()
    with OffloadedOptimizer(torch.optim.Adam, make_params(2), config) as offloaded:
        offloaded.compute_threads = 1

        def fail():
            raise RuntimeError("boom")

        offloaded.pipeline.inner_step = fail  # the wrapped optimizer's step fails
        set_grads(offloaded.pipeline.params(), 0)
        with pytest.raises(RuntimeError, match="boom"):
            offloaded.step()
        assert torch.get_num_threads() == threads


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_values_are_refused(bad, config):
    with OffloadedOptimizer(torch.optim.Adam, make_params(3), config) as offloaded:
        with pytest.raises(ValueError, match="compute_threads: expected a positive number of threads"):
            offloaded.compute_threads = bad
        assert offloaded.compute_threads is None
