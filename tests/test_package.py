"""The package surface: a cheap import, and every public name resolves."""

import subprocess
import sys

import deepoffload


def test_every_public_name_resolves():
    for name in deepoffload.__all__:
        assert getattr(deepoffload, name) is not None, name


def test_import_is_cheap():
    """`import deepoffload` probes, compiles and loads nothing, and does not import torch: of the op builders only
    the package itself is imported (to register the DeepSpeed-shaped module), not its builder or probes."""
    code = ("import sys, deepoffload; print('torch' in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('deepoffload.op_builder')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split(" ", 1) == ["False", "['deepoffload.op_builder']\n"]
