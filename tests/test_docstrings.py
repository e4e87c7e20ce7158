"""Every public name's docstring is what the generated reference shows: Google sections that cover its arguments
(a class's constructor arguments, a dataclass's fields, each public method's arguments), a Returns section where it
returns a value, and an Example that runs (doctest, in a fresh temporary folder; a fenced ``python`` block in a
child process). The public names are the ``__all__`` of the modules in ``PUBLIC_MODULES``. ruff's pydocstyle and
pydoclint rules check the form of every docstring in the library (pyproject.toml); this checks what they cannot:
coverage against the signatures, and that the examples are true."""

import pytest

from tests.support.doc_examples import fenced_examples, problems, public_names, run_examples, run_fenced

FENCED = [(name, i, code) for name in public_names() for i, code in enumerate(fenced_examples(name))]


@pytest.mark.parametrize("name", public_names())
def test_docstring_covers_the_signature(name):
    assert problems(name) == []


@pytest.mark.parametrize("name", public_names())
def test_examples_run(name):
    failures, report = run_examples(name)
    assert failures == 0, report


@pytest.mark.slow
@pytest.mark.parametrize("name, index, code", FENCED, ids=[f"{n}-{i}" for n, i, _ in FENCED])
def test_fenced_examples_run(name, index, code):
    child = run_fenced(code)
    assert child.returncode == 0, f"{name}'s example {index}:\n{code}\n{child.stdout}{child.stderr}"


def test_the_checker_finds_what_is_missing():
    from tests.support import doc_examples

    def f(path: str, count: int = 1) -> int:
        """Summary.

        Args:
            path: A path.
        """
        return count

    assert doc_examples._function_problems("f", f) == ["f: argument 'count' not in Args", "f: no Returns section"]
    assert doc_examples.sections("Line.\n\nExample:\n    >>> 1\n    1\n")["Example"] == ["    >>> 1", "    1"]
