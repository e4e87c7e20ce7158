"""Random training loops (hypothesis) drawn from the optimizer matrix's pieces, compared with the same loop in
memory: optimizer, chunk size, ``step_in_backward`` or not, the number of steps and, per step, what the loop does
between backward and ``step()`` (a GradScaler, when drawn, scales every step and one step overflows). The property:
the run is bit-identical to memory, or raises deepoffload's refusal at the first step whose gradients the loop
changes (``step_in_backward``), identical until then, and before any parameter moves when that is the first step;
an undeclared optimizer is refused at construction, a cross-parameter one at ``step_in_backward()``. Derandomized
with a bounded number of examples, so CI sees the same loops every run."""

from __future__ import annotations

import tempfile

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deepoffload import SwapConfig
from deepoffload.errors import DeepOffloadError
from tests.support import optimizer_harness as harness

EDITS = [a for a in harness.BETWEEN if a not in ("nothing", "scaler")]


@st.composite
def loops(draw):
    steps = draw(st.integers(1, 5))
    actions = draw(st.lists(st.sampled_from(["nothing", "nothing", *EDITS]), min_size=steps, max_size=steps))
    scaled = draw(st.booleans())
    overflow_at = draw(st.none() | st.integers(0, steps - 1)) if scaled else None
    return dict(
        name=draw(st.sampled_from(harness.OPTIMIZERS)),
        size=draw(st.sampled_from(harness.SIZES)),
        in_backward=draw(st.booleans()),
        actions=actions,
        scaled=scaled,
        overflow_at=overflow_at,
        width=draw(st.sampled_from([4, 8, 12])),
    )


def _run(loop, module, optimizer):
    return harness.run_loop(module, optimizer, loop["actions"], loop["width"], loop["scaled"], loop["overflow_at"])


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(loop=loops())
@example(  # an edit after checked steps: refused late, identical until then
    loop=dict(
        name="adam",
        size="many_chunks",
        in_backward=True,
        actions=["nothing", "nothing", "data"],
        scaled=False,
        overflow_at=None,
        width=8,
    )
)
@example(
    loop=dict(
        name="per_param",
        size="many_chunks",
        in_backward=True,
        actions=["nothing"] * 4,
        scaled=False,
        overflow_at=None,
        width=12,
    )
)
def test_random_loops_equal_memory_or_are_refused_at_the_first_change(loop):
    reference = harness.model(loop["width"])
    ref_opt = harness.MAKERS[loop["name"]](harness.groups(reference))
    expected = _run(loop, reference, ref_opt)
    assert expected.error is None
    module = harness.model(loop["width"])
    initial = [p.detach().clone() for p in module.parameters()]
    with tempfile.TemporaryDirectory() as folder:
        config = SwapConfig(folder=folder, chunk_bytes=harness.CHUNK_BYTES[loop["size"]], pin=False)
        try:
            opt = harness.offloaded(loop["name"], harness.groups(module), config, loop["size"])
        except DeepOffloadError:
            assert loop["name"] == "undeclared"
            return
        assert loop["name"] != "undeclared"
        try:
            if loop["in_backward"]:
                try:
                    opt.step_in_backward()
                except DeepOffloadError:
                    assert loop["name"] == "cross_param"
                    return
            got = _run(loop, module, opt)
            if got.error is not None:
                assert loop["in_backward"], got.error
                changes = [k for k, a in enumerate(loop["actions"]) if a != "nothing" or loop["scaled"]]
                assert got.refused == changes[0], (got.refused, changes)
                assert got.losses == expected.losses[: got.refused]
                if got.refused == 0:
                    assert all(torch.equal(a, b) for a, b in zip(initial, module.parameters()))
                return
            assert not (loop["in_backward"] and (loop["scaled"] or set(loop["actions"]) - {"nothing"}))
            assert got.losses == expected.losses
            assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), module.parameters()))
            assert harness._same_state(opt.state_dict()["state"], ref_opt.state_dict()["state"])
        finally:
            opt.close()
