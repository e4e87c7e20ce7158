"""The differential matrix's t5 cells (see cells.py)."""

from tests.swap.params.matrix.cells import test_cell  # noqa: F401

MODEL = "t5"
