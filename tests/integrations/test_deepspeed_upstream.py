"""DeepSpeed's own pinned-memory and GIL tests (``tests/integrations/deepspeed_upstream/``, copied from its
repository) run on deepoffload's op through ``enable()``, in a child pytest (DS_ACCELERATOR=cpu) whose DeepSpeed op
builders refuse to build or load anything of DeepSpeed's own.

``test_aio_gil.py`` needs CUDA-pinned memory and skips its every test on a CPU accelerator, on DeepSpeed's op as on
ours; ``gil_on_cpu`` runs it again with that requirement lifted (``Tensor.pin_memory`` returns a page-locked copy
from ``new_cpu_locked_tensor``), so its GIL and concurrency checks do run here on deepoffload's op."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,  # each child imports DeepSpeed (about 10 s)
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (pip install deepoffload[deepspeed])",
    ),
]
UPSTREAM = Path(__file__).with_name("deepspeed_upstream")
REPO = Path(__file__).resolve().parents[2]

CONFTEST = """
import os
import deepspeed
import pytest
import torch
from deepspeed.ops.op_builder.builder import OpBuilder


def refuse(self, *args, **kwargs):
    raise RuntimeError(f"DeepSpeed tried to build or load its own op {self.name!r}")


OpBuilder.load = OpBuilder.jit_load = OpBuilder.builder = refuse
from deepoffload.integrations import deepspeed as integration

integration.enable()

if os.environ.get("GIL_ON_CPU") == "1":
    from deepoffload.io.pin_memory import pin_handle

    def pinned_copy(self, device=None):
        out = pin_handle().new_cpu_locked_tensor(self.numel(), self).view(self.shape)
        out.copy_(self)
        return out

    torch.Tensor.pin_memory = pinned_copy

    @pytest.fixture(autouse=True)
    def cpu_is_enough(request):
        module = request.module
        if hasattr(module, "_require_aio_cuda"):
            module._require_aio_cuda = lambda: None
"""


def run_upstream(folder: Path, names: list[str], gil_on_cpu: bool = False) -> dict[str, str]:
    """Runs the upstream files ``names`` (without .py) as test_NAME.py in ``folder`` (made here); returns {test id:
    outcome}."""
    folder.mkdir()
    for name in names:
        shutil.copy(UPSTREAM / f"{name}.py", folder / f"test_{name}.py")
    (folder / "conftest.py").write_text(CONFTEST)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "GIL_ON_CPU": "1" if gil_on_cpu else "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=600,
    )
    outcomes = dict(re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", proc.stdout, re.M))
    assert outcomes and proc.returncode in (0, 5), proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "tried to build or load its own op" not in proc.stdout
    return outcomes


def test_deepspeeds_pinned_manager_and_gil_tests_on_our_op(scratch):
    # as on DeepSpeed's op on a CPU accelerator: the pinned-manager tests pass, the GIL tests skip (CUDA needed)
    outcomes = run_upstream(scratch / "as_is", ["pinned_manager", "aio_gil"])
    pinned = {t: o for t, o in outcomes.items() if "pinned_manager" in t}
    gil = {t: o for t, o in outcomes.items() if "aio_gil" in t}
    assert len(pinned) == 5 and set(pinned.values()) == {"PASSED"}, pinned
    assert len(gil) == 7 and set(gil.values()) == {"SKIPPED"}, gil
    # the GIL tests with their CUDA requirement lifted: they run, on deepoffload's op, and pass
    ran = run_upstream(scratch / "on_cpu", ["aio_gil"], gil_on_cpu=True)
    assert len(ran) == 7 and set(ran.values()) == {"PASSED"}, ran
