"""DeepSpeed's own code on deepoffload's op (``deepoffload.integrations.deepspeed.enable()``): ZeRO-3 with optimizer
state (and parameters) swapped to NVMe, checkpoints saved and resumed, the fast checkpoint writer. Each run is a
single-process job (gloo, DeepSpeed's CPU accelerator) in a child process, in which every DeepSpeed op builder's
``load``/``jit_load``/``builder`` raises: so DeepSpeed builds none of its ops, its async_io op included."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,  # each child imports DeepSpeed (about 10 s) and starts its engines
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (pip install deepoffload[deepspeed])",
    ),
]
CHILD = Path(__file__).resolve().parents[1] / "support" / "deepspeed_child.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(mode: str, folder: Path, steps: int = 3, op: str = "deepoffload") -> dict:
    """Runs tests/support/deepspeed_child.py MODE in a child process, on deepoffload's op or (``op="deepspeed"``, built
    already) on DeepSpeed's own; returns its JSON result."""
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "LOCAL_SIZE": "1",
        "DEEPOFFLOAD_CHILD_OP": op,
    }
    proc = subprocess.run(
        [sys.executable, str(CHILD), mode, str(folder), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-3000:]
    result = json.loads(lines[-1])
    assert "tried to build or load its own op" not in proc.stderr
    return result


def check_against_memory(r: dict) -> None:
    """Losses bit-identical to ZeRO-3 in memory; final parameters equal up to last-bit rounding of DeepSpeed's
    NVMe update path (a stale or lost swap read would differ by a whole update)."""
    assert r["handle_types"] == ["deepoffload.io.compat"]
    assert r["losses"] == r["reference_losses"]
    assert r["params_match_reference"] or r["params_max_abs_diff"] < 1e-3 * r["params_moved"], r


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """resume(): ZeRO-3 with the optimizer state on NVMe trained against ZeRO-3 in memory, saved, resumed."""
    base = os.environ.get("DEEPOFFLOAD_TEST_DIR")
    folder = Path(tempfile.mkdtemp(dir=base, prefix="resume-")) if base else tmp_path_factory.mktemp("resume")
    try:
        return resume(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_zero3_optimizer_state_on_nvme(resumed):
    check_against_memory(resumed)
    assert resumed["optimizer_swap_files"] > 0 and resumed["param_swap_files"] == 0


def test_zero3_parameters_and_optimizer_state_on_nvme(scratch):
    r = run_child("param", scratch)
    check_against_memory(r)
    assert r["optimizer_swap_files"] > 0 and r["param_swap_files"] > 0


def resume(folder: Path, op: str = "deepoffload") -> dict:
    """A checkpoint saved with the optimizer state on NVMe, resumed in the same process and in a fresh one."""
    folder.mkdir(exist_ok=True)
    saved = run_child("resume_save", folder, op=op)
    return {**saved, **run_child("resume_load", folder, op=op)}


def test_checkpoint_with_optimizer_state_on_nvme_resumes_as_deepspeed_does(resumed):
    """DeepSpeed 0.19.8 (its own op behaves the same: test_resume_equals_deepspeeds_own_op) resumes such a
    checkpoint by copying the swap files back, and nothing else of the optimizer: in a fresh process the parameters
    come back bit-identical but Adam restarts (no moments, step 0); a second engine in the same process gets new
    parameter ids, reads its own swap files under those names, and keeps its initial parameters."""
    r = resumed
    assert r["handle_types"] == ["deepoffload.io.compat"]
    assert r["fp32_files"] == 1 and r["fp32_in_checkpoint_equal"] and r["state_files"] > 0
    assert r["fresh_process_ids"] == r["ids"] and r["fresh_process_params_restored"]
    assert r["fresh_process_optimizer_state_entries"] == 0
    assert r["fresh_process_losses"][0] == r["losses_after_save"][0]  # same parameters, same first loss
    assert r["fresh_process_losses"] == r["fresh_process_losses_fresh_adam"]
    # within last-bit rounding of DeepSpeed's NVMe update path; Adam's moments kept would move them by ~1e-4
    assert r["fresh_process_params_max_abs_diff_fresh_adam"] < 1e-6
    assert r["same_process_ids"] != r["fresh_process_ids"] and not r["same_process_params_restored"]
    # enable() adds one warning to each of these resumes, naming the restart (DeepSpeed says nothing)
    for name in ("fresh_process", "same_process"):
        ours = [m for m in r[f"{name}_load_warnings"] if m.startswith("DeepSpeed resumed")]
        assert len(ours) == 1 and "Adam restarts from zero" in ours[0] and "keep it off NVMe" in ours[0], ours


def deepspeeds_op_is_built() -> bool:
    """True when DeepSpeed's async_io op is in torch's extension cache (else loading it builds it: minutes)."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory("async_io", verbose=False))
    return any(folder.glob("async_io*.so"))


def test_resume_equals_deepspeeds_own_op(resumed, scratch):
    """The same training, save and resumes on DeepSpeed's own async_io op: every figure equal, losses included;
    only enable()'s resume warning is ours alone."""
    if os.environ.get("DEEPOFFLOAD_TEST_DEEPSPEED_OP") != "1":  # a build cached for another venv is rebuilt: minutes
        pytest.skip("set DEEPOFFLOAD_TEST_DEEPSPEED_OP=1 to compare with DeepSpeed's own async_io op")
    if not deepspeeds_op_is_built():
        pytest.skip(
            "DeepSpeed's async_io op is not built here (it takes minutes: build it with "
            "python -c 'from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()')"
        )
    theirs = resume(scratch, op="deepspeed")
    assert theirs["handle_types"] != resumed["handle_types"]  # DeepSpeed's op really ran
    ignore = ("handle_types", "mode", "fresh_process_load_warnings", "same_process_load_warnings")
    assert {k: v for k, v in resumed.items() if k not in ignore} == {k: v for k, v in theirs.items() if k not in ignore}
    # the only difference: enable()'s warning, which DeepSpeed's own op run (no enable()) does not get
    for name in ("fresh_process", "same_process"):
        assert not any(m.startswith("DeepSpeed resumed") for m in theirs[f"{name}_load_warnings"])
        assert [m for m in resumed[f"{name}_load_warnings"] if not m.startswith("DeepSpeed resumed")] == theirs[
            f"{name}_load_warnings"
        ]


def test_fast_checkpoint_writer_saves_and_resumes(scratch):
    r = run_child("fast_checkpoint", scratch)
    assert r["writer_handle_type"] == "deepoffload.io.compat"
    assert r["params_restored"] and r["losses_after_resume"] == r["losses_after_save"] and r["params_equal"]
    assert r["handle_type"] == "deepoffload.io.compat" and r["loaded_equal"]  # torch.save through FastFileWriter


def test_enable_disable_and_gds(scratch):
    code = """
import deepspeed, json
from deepspeed.accelerator import get_accelerator
import deepspeed.runtime.swap_tensor.partitioned_param_swapper as pps
import deepspeed.runtime.model_checkpointing.writer_factory as wf
from deepoffload.integrations import deepspeed as integration
import sys
original = pps.AsyncIOBuilder
original_gds = __import__("deepspeed.ops.op_builder", fromlist=["x"]).GDSBuilder
import os
integration.enable(); integration.enable()
out = {"env_for_children": os.environ.get("DEEPOFFLOAD_DEEPSPEED"),
       "pin": type(__import__("deepspeed.ops.op_builder", fromlist=["x"]).PinMemoryBuilder().load().pin_handle()
                   ).__module__,
       "compatible": [deepspeed.ops.__compatible_ops__[n] for n in ("async_io", "pin_memory")],
       "swapper": pps.AsyncIOBuilder is integration.AsyncIOBuilder,
       "writer": wf.AsyncIOBuilder is integration.AsyncIOBuilder,
       "ops_aio": __import__("deepspeed.ops.aio", fromlist=["x"]).AsyncIOBuilder is integration.AsyncIOBuilder,
       "accelerator": isinstance(get_accelerator().create_op_builder("AsyncIOBuilder"), integration.AsyncIOBuilder),
       "handle": type(pps.AsyncIOBuilder().load().aio_handle()).__module__}
modules = {n: m for n, m in list(sys.modules.items()) if n.startswith("deepspeed") and m is not None}
out["still_theirs"] = sorted(n for n, m in modules.items()
                             if vars(m).get("AsyncIOBuilder") is original or vars(m).get("GDSBuilder") is original_gds)
out["patched"] = sorted(n for n, m in modules.items() if vars(m).get("AsyncIOBuilder") is integration.AsyncIOBuilder)
try:
    wf.GDSBuilder().load()
except RuntimeError as e:
    out["gds"] = str(e)
integration.disable(); integration.disable()
out["restored"] = pps.AsyncIOBuilder is original and not integration.enabled()
out["env_restored"] = "DEEPOFFLOAD_DEEPSPEED" not in os.environ
out["accelerator_restored"] = get_accelerator().get_op_builder("AsyncIOBuilder") is original
print(json.dumps(out))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        cwd=scratch,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["swapper"] and out["writer"] and out["ops_aio"] and out["accelerator"]
    assert out["still_theirs"] == []  # every module that bound DeepSpeed's builders now binds ours
    assert {
        "deepspeed.nvme.ds_aio_handle",
        "deepspeed.nvme.perf_run_sweep",
        "deepspeed.ops.op_builder",
        "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
    } <= set(out["patched"]), out["patched"]
    assert out["handle"] == "deepoffload.io.compat"
    assert "GPUDirect Storage" in out["gds"] and "use_gds" in out["gds"]
    assert out["restored"] and out["accelerator_restored"]
    # children enable themselves (tests/integrations/test_deepspeed_children.py); DeepSpeed's pin_memory op is ours too
    assert out["env_for_children"] == "1" and out["env_restored"]
    assert out["pin"] == "deepoffload.io.pin_memory" and out["compatible"] == [True, True]
