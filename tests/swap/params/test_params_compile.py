"""torch.compile with streamed blocks, against the same compiled code in memory.

- ``torch.compile(model)``: each streamed block is a graph break and runs outside the compiled graph; the result is
  bit-identical to the model in memory compiled with its blocks excluded (``torch.compiler.disable`` on each block's
  forward), inference and training, and a warning says so at the first compiled forward. (It is not the model
  compiled whole: inductor's fusions across the blocks round differently.)
- ``block.compile()`` on a streamed block: the block's compiled forward runs, with its parameters resident, and is
  bit-identical to ``block.compile()`` in memory (with a counting backend and with inductor); a block compiled
  before offloading is refused (its compiled code would run uncompiled), and compiling after offloading works.
"""

from __future__ import annotations

import pytest
import torch

from deepoffload import TrainOptions
from deepoffload.errors import UnsupportedError
from deepoffload.swap.params import offload_parameters
from tests.support.stepping import offload_step, reference_step
from tests.swap.params.test_params_patterns import adam, batches, pair, states_equal, train


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test compiles afresh: dynamo caches compiled code per code object, and every test compiles Unit.forward
    with its own backend."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def counting_backend(runs: list):
    """A torch.compile backend whose compiled graphs count each call (proof that compiled code ran)."""

    def backend(graph, example_inputs):
        def run(*args):
            runs.append(1)
            return graph.forward(*args)

        return run

    return backend


def both_ways(model, reference, off, optimizer, compiled_model, compiled_reference, steps: int = 3) -> None:
    """Inference then ``steps`` training steps of both, asserting identical outputs, losses and states."""
    x = batches(1)[0]
    with torch.no_grad():
        model.eval(), reference.eval()
        assert torch.equal(compiled_model(x), compiled_reference(x))
    model.train(), reference.train()
    for x in batches(steps, seed=2):
        assert train(compiled_model, offload_step(off), x) == train(compiled_reference, reference_step(optimizer), x)
    assert states_equal(model.state_dict(), reference.state_dict())


def test_compiled_model_equals_memory_compiled_with_blocks_excluded(scratch):
    reference, model = pair()
    for block in reference.blocks:
        block.forward = torch.compiler.disable(block.forward)
    optimizer = adam(reference.parameters())
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)) as off:
        with pytest.warns(UserWarning, match="graph break.*bit for bit.*torch.compiler.disable") as caught:
            both_ways(model, reference, off, optimizer, torch.compile(model), torch.compile(reference))
        assert sum("streamed blocks" in str(w.message) for w in caught) == 1  # once, at the first compiled forward


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_block_compile_runs_the_compiled_forward(scratch, mode):
    runs, reference_runs = [], []
    reference, model = pair()
    for block in reference.blocks:
        block.compile(backend=counting_backend(reference_runs))
    optimizer = adam(reference.parameters())
    with offload_parameters(model, str(scratch), train=TrainOptions(mode=mode, optimizer=adam)) as off:
        for block in model.blocks:
            block.compile(backend=counting_backend(runs))
        both_ways(model, reference, off, optimizer, model, reference)
        assert len(runs) >= 3 * 4  # every block call ran compiled code (and its recompute in training)
    for block in model.blocks:  # closed: the blocks are still compiled, in memory
        assert block._compiled_call_impl is not None


def test_block_compile_with_inductor_is_bit_identical(scratch):
    reference, model = pair()
    for block in reference.blocks:
        block.compile()
    optimizer = adam(reference.parameters())
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)) as off:
        for block in model.blocks:
            block.compile()
        both_ways(model, reference, off, optimizer, model, reference)


def test_block_compiled_before_offloading_is_refused_and_compiling_after_works(scratch):
    reference, model = pair()
    model.blocks[1].compile(backend=counting_backend([]))
    with pytest.raises(UnsupportedError, match=r"\['blocks.1'\] were compiled.*before offloading.*block.compile"):
        offload_parameters(model, str(scratch))
    del model.blocks[1]._compiled_call_impl  # the advice: offload first, then compile
    runs: list = []
    with offload_parameters(model, str(scratch)), torch.no_grad():
        model.blocks[1].compile(backend=counting_backend(runs))
        model.eval(), reference.eval()
        x = batches(1)[0]
        assert torch.equal(model(x), reference(x)) and runs


@pytest.mark.parametrize("options", [dict(mode="reduce-overhead"), dict(options={"triton.cudagraphs": True})])
def test_block_compile_with_cuda_graphs_is_refused_and_the_default_mode_works(scratch, options):
    reference, model = pair()
    with offload_parameters(model, str(scratch)), torch.no_grad():
        with pytest.raises(UnsupportedError, match="CUDA graphs.*mode='default'"):
            model.blocks[0].compile(**options)
        model.blocks[0].compile(mode="default", backend=counting_backend(runs := []))
        model.eval(), reference.eval()
        x = batches(1)[0]
        assert torch.equal(model(x), reference(x)) and runs
