"""When an offloaded step gives freed heap memory back (``ChunkPipeline.trim``): after each chunk whose state lived in
ordinary memory, once the resident memory grew a staging buffer's bytes since the first chunk after the last trim, and
once as the step ends; never after every chunk of a steady step, whose temporaries reuse the heap pages the previous
chunk's left (trimming them made each chunk fault them in again). The resident memory is faked here, so each rule is
seen apart from glibc's own behaviour; the memory harness (tests/memory) checks the real peak against its bound."""

from __future__ import annotations

import pytest
import torch

import deepoffload.swap.optimizer_pipeline as optimizer_pipeline
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer

CHUNK = 8192
LAYERS = 6


@pytest.fixture
def config(scratch):
    return SwapConfig(folder=str(scratch), chunk_bytes=CHUNK, buffer_count=4, pin=False)  # a chunk per layer


class Heap:
    """Counts the trims and plays the resident memory the pipeline reads: ``grow`` bytes more at every look,
    ``once`` more at the second look only, and the gradients of ``model`` that exist at the look."""

    def __init__(self, monkeypatch, grow: int = 0, once: int = 0, model: torch.nn.Module | None = None):
        self.trims, self.looks, self.resident, self.grow, self.once = 0, 0, 1 << 30, grow, once
        self.model = model
        monkeypatch.setattr(optimizer_pipeline, "trim_heap", self.trim)
        monkeypatch.setattr(optimizer_pipeline, "resident_bytes", self.look)

    def trim(self) -> None:
        self.trims += 1

    def look(self) -> int:
        self.looks += 1
        self.resident += self.grow + (self.once if self.looks == 2 else 0)
        params = self.model.parameters() if self.model is not None else []
        return self.resident + sum(p.grad.nbytes for p in params if p.grad is not None)


def model_and_optimizer(config: SwapConfig) -> tuple[torch.nn.Module, OffloadedOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(LAYERS)])
    return model, OffloadedOptimizer(torch.optim.Adam, model.parameters(), config, lr=1e-2)


def step(model: torch.nn.Module, opt: OffloadedOptimizer, k: int) -> None:
    model(torch.randn(8, 24, generator=torch.Generator().manual_seed(k))).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_a_steady_step_trims_once_as_it_ends(config, monkeypatch):
    model, opt = model_and_optimizer(config)
    step(model, opt, 0)  # the state is made in memory and stored
    heap = Heap(monkeypatch)
    chunks = len(opt.pipeline.chunks([p for p in model.parameters()]))
    assert chunks == LAYERS  # the rule below is about many chunks a step
    step(model, opt, 1)
    assert heap.trims == 1
    opt.close()


def test_the_first_step_trims_after_every_chunk_of_state_made_in_memory(config, monkeypatch):
    model, opt = model_and_optimizer(config)
    heap = Heap(monkeypatch)
    step(model, opt, 0)
    assert heap.trims >= LAYERS  # each chunk's state, copied out of ordinary memory, freed; then the step's end
    opt.close()


def test_heap_growth_of_a_buffer_is_trimmed_within_the_step(config, monkeypatch):
    model, opt = model_and_optimizer(config)
    step(model, opt, 0)
    buffer = opt.swapper.pool.buffer_bytes
    assert buffer >= CHUNK
    heap = Heap(monkeypatch, grow=buffer)  # every chunk leaves a buffer's bytes more resident
    step(model, opt, 1)
    # the first look after a trim takes the mark; the next one, a buffer above it, trims: every other chunk
    assert heap.trims == LAYERS // 2 + 1
    heap = Heap(monkeypatch, once=buffer - 1)  # just under, in one chunk: only the step's end
    step(model, opt, 2)
    assert heap.trims == 1
    heap = Heap(monkeypatch, once=buffer)
    step(model, opt, 3)
    assert heap.trims == 2
    opt.close()


def test_step_in_backward_does_not_count_the_gradients_backward_made_as_heap_growth(config, monkeypatch):
    model, opt = model_and_optimizer(config)
    opt.step_in_backward()
    step(model, opt, 0)  # makes the state; this step only checks
    step(model, opt, 1)
    # backward makes the gradients of each chunk before it steps: the resident memory grows by them at each look
    buffer = opt.swapper.pool.buffer_bytes
    heap = Heap(monkeypatch, once=buffer - 1, model=model)
    step(model, opt, 2)
    assert heap.trims == 1  # the step's end only: what grew beyond the gradients stayed under a buffer
    heap = Heap(monkeypatch, once=buffer, model=model)
    step(model, opt, 3)
    assert heap.trims == 2
    opt.close()


def test_without_the_resident_memory_it_trims_every_buffer_of_state_read(config, monkeypatch):
    """Where ``/proc/self/statm`` cannot be read: a trim each time a buffer's bytes of state were read."""
    model, opt = model_and_optimizer(config)
    step(model, opt, 0)
    heap = Heap(monkeypatch)
    monkeypatch.setattr(optimizer_pipeline, "resident_bytes", lambda: None)
    before = opt.swapper.bytes_read
    step(model, opt, 1)
    read = opt.swapper.bytes_read - before
    assert read > opt.swapper.pool.buffer_bytes  # the rule below is about steps that read more than a buffer
    chunks = len(opt.pipeline.chunks([p for p in model.parameters()]))
    # within the step at least once, at most once a buffer read (not after every chunk); then the step's end
    assert 1 < heap.trims <= read // opt.swapper.pool.buffer_bytes + 1 < chunks + 1
    opt.close()
