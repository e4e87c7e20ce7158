"""The differential matrix's deepseek_v3 cells (see cells.py)."""

from tests.swap.params.matrix.cells import test_cell  # noqa: F401

MODEL = "deepseek_v3"
