"""The whole differential matrix in the slow run: every cell of one model that the pairwise cover
(``test_params_matrix.py``) does not run, with the outcome ``docs/support-matrix.md`` shows. One file per model
(``test_<model>.py``, which imports ``test_cell`` and names its ``MODEL``), so pytest-xdist's per-file distribution
spreads the 400 cells over its workers; ``conftest.py`` parametrizes ``cell`` from the file's ``MODEL``."""

from __future__ import annotations

import itertools

import pytest

from tests.support import matrix_harness as harness
from tests.swap.params.test_params_matrix import check, documented, pairwise


def cells_of(model: str) -> list[tuple[str, str, str, str]]:
    covered = set(pairwise())
    return [
        c for c in itertools.product([model], harness.PRECISIONS, harness.LOOPS, harness.FEATURES) if c not in covered
    ]


@pytest.mark.slow
def test_cell(scratch, cell):
    outcome = check(cell, scratch)
    assert documented()[cell] in (outcome.status, "not run")
