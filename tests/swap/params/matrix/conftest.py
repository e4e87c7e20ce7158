"""Parametrizes each model file's ``cell`` from its ``MODEL`` (see cells.py)."""

from tests.swap.params.matrix.cells import cells_of


def pytest_generate_tests(metafunc):
    model = getattr(metafunc.module, "MODEL", None)
    if model is not None and "cell" in metafunc.fixturenames:
        metafunc.parametrize("cell", cells_of(model), ids="-".join)
