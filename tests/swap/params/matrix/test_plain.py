"""The differential matrix's plain cells (see cells.py)."""

from tests.swap.params.matrix.cells import test_cell  # noqa: F401

MODEL = "plain"
