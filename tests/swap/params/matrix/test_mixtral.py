"""The differential matrix's mixtral cells (see cells.py)."""

from tests.swap.params.matrix.cells import test_cell  # noqa: F401

MODEL = "mixtral"
