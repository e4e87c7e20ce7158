"""The differential matrix's qwen2_moe cells (see cells.py)."""

from tests.swap.params.matrix.cells import test_cell  # noqa: F401

MODEL = "qwen2_moe"
