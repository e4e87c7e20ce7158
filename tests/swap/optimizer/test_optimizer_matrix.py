"""The optimizer's differential matrix (``tests/support/optimizer_harness.py``): optimizer (built-in, hand-written
per-parameter, hand-written cross-parameter, undeclared) x size (one chunk, many chunks, many chunks with
Adam stepping each parameter in slices) x what happens between
backward and ``step()`` (nothing, clipping, a GradScaler with an overflowing step, in-place edits, ``.data`` edits,
reassignment) x ``step_in_backward`` or not. Every cell is bit-identical to the in-memory run or refused before any
parameter moves, as ``expected`` says; the whole product runs by default (tiny models), a wider model with many
chunks per step is marked slow."""

from __future__ import annotations

import itertools

import pytest

from tests.support import optimizer_harness as harness

CELLS = list(itertools.product(harness.OPTIMIZERS, harness.SIZES, harness.BETWEEN, harness.MODES))


@pytest.mark.parametrize("cell", CELLS, ids="-".join)
def test_cell(cell):
    outcome = harness.run_cell(*cell)
    assert outcome.status == harness.expected(*cell), f"{cell}: {outcome.status}: {outcome.detail}"


def test_the_matrix_has_both_outcomes_in_every_mode():
    by_mode = {mode: {harness.expected(*c) for c in CELLS if c[3] == mode} for mode in harness.MODES}
    assert by_mode == {"step": {"identical", "refused"}, "in_backward": {"identical", "refused"}}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adam", "per_param", "cross_param"])
@pytest.mark.parametrize("action", ["nothing", "clip", "scaler"])
def test_wider_model_many_chunks(scratch, name, action):
    outcome = harness.compare(name, "many_chunks", [action] * 6, "step", str(scratch), width=96)
    assert outcome.status == "identical", outcome.detail
