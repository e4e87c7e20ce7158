"""DeepSpeed's own code on deepoffload's op (``deepoffload.integrations.deepspeed.enable()``): ZeRO-3 with optimizer
state (and parameters) swapped to NVMe, checkpoints saved and resumed, the fast checkpoint writer. Each run is a
single-process job (gloo, DeepSpeed's CPU accelerator) in a child process, in which every DeepSpeed op builder's
``load``/``jit_load``/``builder`` raises: so DeepSpeed builds none of its ops, its async_io op included."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,  # each child imports DeepSpeed (about 10 s) and starts its engines
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (pip install deepoffload[deepspeed])"),
]
CHILD = Path(__file__).with_name("deepspeed_child.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(mode: str, folder: Path, steps: int = 3) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "CROSS_RANK": "0", "CROSS_SIZE": "1",
           "LOCAL_SIZE": "1"}
    proc = subprocess.run([sys.executable, str(CHILD), mode, str(folder), str(steps)], capture_output=True,
                          text=True, env=env, cwd=folder, timeout=600)
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


def test_zero3_optimizer_state_on_nvme(scratch):
    r = run_child("optimizer", scratch)
    check_against_memory(r)
    assert r["optimizer_swap_files"] > 0 and r["param_swap_files"] == 0


def test_zero3_parameters_and_optimizer_state_on_nvme(scratch):
    r = run_child("param", scratch)
    check_against_memory(r)
    assert r["optimizer_swap_files"] > 0 and r["param_swap_files"] > 0


def test_checkpoint_with_optimizer_state_on_nvme(scratch):
    r = run_child("checkpoint", scratch)
    assert r["fp32_files"] == 1 and r["fp32_in_checkpoint_equal"] and r["state_files"] > 0


def test_fast_checkpoint_writer_saves_and_resumes(scratch):
    r = run_child("fast_checkpoint", scratch)
    assert r["writer_handle_type"] == "deepoffload.io.compat"
    assert r["params_restored"] and r["losses_after_resume"] == r["losses_after_save"] and r["params_equal"]


def test_fast_file_writer_through_our_op(scratch):
    r = run_child("fast_writer", scratch)
    assert r["handle_type"] == "deepoffload.io.compat" and r["loaded_equal"]


def test_enable_disable_and_gds(scratch):
    code = """
import deepspeed, json
from deepspeed.accelerator import get_accelerator
import deepspeed.runtime.swap_tensor.partitioned_param_swapper as pps
import deepspeed.runtime.model_checkpointing.writer_factory as wf
from deepoffload.integrations import deepspeed as integration
original = pps.AsyncIOBuilder
integration.enable(); integration.enable()
out = {"swapper": pps.AsyncIOBuilder is integration.AsyncIOBuilder,
       "writer": wf.AsyncIOBuilder is integration.AsyncIOBuilder,
       "ops_aio": __import__("deepspeed.ops.aio", fromlist=["x"]).AsyncIOBuilder is integration.AsyncIOBuilder,
       "accelerator": isinstance(get_accelerator().create_op_builder("AsyncIOBuilder"), integration.AsyncIOBuilder),
       "handle": type(pps.AsyncIOBuilder().load().aio_handle()).__module__}
try:
    wf.GDSBuilder().load()
except RuntimeError as e:
    out["gds"] = str(e)
integration.disable(); integration.disable()
out["restored"] = pps.AsyncIOBuilder is original and not integration.enabled()
out["accelerator_restored"] = get_accelerator().get_op_builder("AsyncIOBuilder") is original
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=scratch)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["swapper"] and out["writer"] and out["ops_aio"] and out["accelerator"]
    assert out["handle"] == "deepoffload.io.compat"
    assert "GPUDirect Storage" in out["gds"] and "use_gds" in out["gds"]
    assert out["restored"] and out["accelerator_restored"]
