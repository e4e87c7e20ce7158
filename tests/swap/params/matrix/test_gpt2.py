"""The differential matrix's gpt2 cells (see cells.py)."""

from tests.swap.params.matrix.cells import test_cell  # noqa: F401

MODEL = "gpt2"
