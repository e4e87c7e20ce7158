"""The differential matrix (``tests/support/matrix_harness.py``): every cell trains identically to memory or is
refused before its first step. A few cells run by default; with ``-m slow`` every pair of axis values (a pairwise
cover of model x precision x loop x feature) runs here and every other cell of the product in ``matrix/`` (one file
per model), and each outcome must be the one ``docs/support-matrix.md`` shows (the harness wrote that file:
``python tests/support/matrix_harness.py --write docs/support-matrix.md`` runs the whole product)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from tests.support import matrix_harness as harness  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
DOC = Path(__file__).resolve().parents[3] / "docs" / "support-matrix.md"


def pairwise() -> list[tuple[str, str, str, str]]:
    """Cells covering every pair of values of two axes at least once (greedy, deterministic)."""
    axes = (harness.MODELS, harness.PRECISIONS, harness.LOOPS, harness.FEATURES)
    todo = {(i, a, j, b) for i, j in itertools.combinations(range(4), 2) for a in axes[i] for b in axes[j]}
    chosen = []
    while todo:
        best = max(
            itertools.product(*axes),
            key=lambda c: sum((i, c[i], j, c[j]) in todo for i, j in itertools.combinations(range(4), 2)),
        )
        chosen.append(best)
        todo -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(4), 2)}
    return chosen


def documented() -> dict[tuple[str, str, str, str], str]:
    """The outcome of each cell as docs/support-matrix.md shows it."""
    return {cell: outcome.status for cell, outcome in harness.page_outcomes(DOC.read_text()).items()}


def check(cell, folder) -> harness.Outcome:
    outcome = harness.run_cell(*cell, folder)
    assert harness.acceptable(cell[0], outcome), f"{cell}: {outcome.status}: {outcome.detail}"
    return outcome


@pytest.mark.parametrize(
    "cell",
    [
        ("llama", "bf16", "plain", "fused"),
        ("plain", "fp32", "plain", "grads"),
        ("gpt2", "fp16", "plain", "fused"),
        ("llama", "fp32", "plain", "serve"),
        ("llama", "bf16", "plain", "activations"),
        # BatchNorm updates its saved running statistics in its kernel without a version bump: copied at the save
        ("plain", "bf16", "plain", "activations"),
        ("llama", "fp32", "plain", "storage_cache"),
        ("llama", "fp32", "lora_served", "fused"),
    ],
    ids="-".join,
)
def test_fast_cells(scratch, cell):
    check(cell, scratch)


def test_the_pairwise_cover_covers_every_pair():
    cells = pairwise()
    for (i, axis_i), (j, axis_j) in itertools.combinations(
        enumerate((harness.MODELS, harness.PRECISIONS, harness.LOOPS, harness.FEATURES)), 2
    ):
        assert {(c[i], c[j]) for c in cells} == set(itertools.product(axis_i, axis_j))
    assert len(cells) < len(harness.MODELS) * len(harness.FEATURES) + 10  # (the largest pair of axes, and a few)


@pytest.mark.slow
@pytest.mark.parametrize("cell", pairwise(), ids="-".join)
def test_pairwise_cells_match_the_support_matrix(scratch, cell):
    outcome = check(cell, scratch)
    shown = documented()[cell]
    assert shown in (outcome.status, "not run")  # (a cell the last full run did not reach is only checked here)
