"""The differential matrix's llama cells (see cells.py)."""

from tests.swap.params.matrix.cells import test_cell  # noqa: F401

MODEL = "llama"
