"""The whole differential matrix in the slow run: every cell of one model that the pairwise cover
(``test_params_matrix.py``) does not run, with the outcome ``docs/support-matrix.md`` shows. One file per model
(``test_<model>.py``, which imports ``test_cell`` and names its ``MODEL``), so pytest-xdist's per-file distribution
spreads the 400 cells over its workers; ``conftest.py`` parametrizes ``cell`` from the file's ``MODEL``."""

from __future__ import annotations

import itertools
import os

import pytest

from tests.support import matrix_harness as harness
from tests.swap.params.test_params_matrix import check, documented, pairwise

# CI's budget: every cell of the hand-written loop, and the other loops' cells of the models and features the matrix
# began with; the rest of the product only with DEEPOFFLOAD_TEST_FULL_MATRIX=1 (as run to write the page).
FULL = os.environ.get("DEEPOFFLOAD_TEST_FULL_MATRIX") == "1"
FIRST_MODELS = ("llama", "gpt2", "t5", "mixtral", "plain")
FIRST_LOOPS = ("plain", "trainer", "accelerate", "lora")
FIRST_FEATURES = ("optimizer", "fused", "grads", "half", "serve")


def in_ci(cell: tuple[str, str, str, str]) -> bool:
    model, _, loop, feature = cell
    return FULL or loop == "plain" or (model in FIRST_MODELS and loop in FIRST_LOOPS and feature in FIRST_FEATURES)


def cells_of(model: str) -> list[tuple[str, str, str, str]]:
    covered = set(pairwise())
    return [
        c
        for c in itertools.product([model], harness.PRECISIONS, harness.LOOPS, harness.FEATURES)
        if c not in covered and in_ci(c)
    ]


@pytest.mark.slow
def test_cell(scratch, cell):
    outcome = check(cell, scratch)
    assert documented()[cell] in (outcome.status, "not run")
