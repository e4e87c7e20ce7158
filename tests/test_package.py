"""The package surface: a cheap import, and every public name resolves."""

import subprocess
import sys

import deepoffload


def test_every_public_name_resolves():
    for name in deepoffload.__all__:
        assert getattr(deepoffload, name) is not None, name


def test_import_is_cheap():
    """`import deepoffload` probes, compiles and loads nothing, and does not import torch."""
    code = "import sys, deepoffload; print('torch' in sys.modules, 'deepoffload.op_builder' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
