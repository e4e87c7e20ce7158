"""``enable()`` reaching DeepSpeed's child processes: the line of ``deepoffload-deepspeed.pth`` is inert unless
``DEEPOFFLOAD_DEEPSPEED=1``; with it, a process enables deepoffload's op when it imports DeepSpeed; and a
``ds_nvme_tune`` sweep in a fresh venv carrying the .pth runs its ``ds_io`` children on deepoffload's op."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from deepoffload.integrations import deepspeed_children as children

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, env_value: str | None, extra_path: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != children.ENV}
    if env_value is not None:
        env[children.ENV] = env_value
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (REPO, extra_path) if p is not None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PTH_PROBE = f"""
import json, sys
before = list(sys.meta_path)
exec({children.PTH_LINE!r})
# (importing deepoffload from a checkout also adds _link's op_builder alias finder: not the line's)
added = [f for f in sys.meta_path if f not in before and type(f).__module__ != "deepoffload._link"]
print(json.dumps({{"imported": sorted(m for m in sys.modules if m.startswith("deepoffload")),
                   "finders": len(added)}}))
"""


def test_pth_line_names_the_variable_of_the_env_table():
    # the table of this tree (deepoffload.op_builder may be mapped to another checkout by an editable install)
    assert re.search(rf'Variable\(\s*"{children.ENV}"', (REPO / "op_builder" / "env.py").read_text())
    assert f"os.environ.get({children.ENV!r}) == '1'" in children.PTH_LINE


def test_pth_line_is_inert_without_the_variable():
    for value in (None, "", "0"):
        assert run_python(PTH_PROBE, value) == {"imported": [], "finders": 0}


def test_pth_line_waits_for_deepspeed_with_the_variable():
    out = run_python(PTH_PROBE, "1")
    assert out["finders"] == 1 and "deepoffload.integrations.deepspeed_children" in out["imported"]
    assert "deepoffload.integrations.deepspeed" not in out["imported"]  # nothing of DeepSpeed's side yet


def test_enables_once_after_deepspeed_is_imported(tmp_path):
    # A stand-in deepspeed package records whether enable() came after its __init__ ran, and how often.
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("INITIALISED = True\n")
    code = f"""
import json, sys
from deepoffload.integrations import deepspeed_children as children
calls = []
children._enable = lambda: calls.append(getattr(sys.modules["deepspeed"], "INITIALISED", False))
exec({children.PTH_LINE!r})
import deepspeed
import deepspeed
children.install()  # deepspeed already imported: enables at once
print(json.dumps({{"calls": calls, "finders_left": [type(f).__name__ for f in sys.meta_path
                                                    if type(f).__module__ == children.__name__],
                   "loader_ok": deepspeed.__spec__.loader is not None}}))
"""
    out = run_python(code, "1", tmp_path)
    assert out == {"calls": [True, True], "finders_left": [], "loader_ok": True}


needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install deepoffload[deepspeed])",
)


def fresh_venv_with_pth(folder: Path) -> Path:
    """A venv (no pip) seeing this environment's packages and the repository, with the package's .pth installed;
    DeepSpeed's ds_io and ds_nvme_tune scripts are copied into it to start with its python."""
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (purelib / "_shared_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n" + str(REPO) + "\n")
    (purelib / children.PTH_NAME).write_text(children.PTH_LINE + "\n")
    scripts = Path(sys.executable).parent
    for name in ("ds_io", "ds_nvme_tune"):
        body = (scripts / name).read_text().split("\n", 1)[1]
        (venv / "bin" / name).write_text(f"#!{python}\n{body}")
        (venv / "bin" / name).chmod(0o755)
    return venv


def nvme_tune(venv: Path, folder: Path, enabled: bool) -> subprocess.CompletedProcess:
    """A one-point read-and-write sweep of 4 MiB. torch's extension folder lies under a plain file, so DeepSpeed
    building any op of its own fails at once instead of taking minutes."""
    (folder / "not-a-folder").write_text("")
    trap = folder / "not-a-folder" / "torch_extensions"
    sweep = folder / "sweep.json"
    sweep.write_text(
        json.dumps(
            {
                "block_size": ["1M"],
                "queue_depth": [8],
                "sequential_requests": [True],
                "single_submit": [False],
                "io_parallel": [1],
            }
        )
    )
    (folder / "nvme").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (children.ENV, "PYTHONPATH")}
    env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(trap), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    if enabled:
        env[children.ENV] = "1"
    return subprocess.run(
        [
            str(venv / "bin" / "ds_nvme_tune"),
            "--nvme_dir",
            str(folder / "nvme"),
            "--sweep_config",
            str(sweep),
            "--io_size",
            "4M",
            "--log_dir",
            str(folder / "logs"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=600,
    )


@pytest.mark.slow  # ds_nvme_tune and two ds_io import DeepSpeed (about 10 s each); the control once more
@needs_deepspeed
def test_ds_nvme_tune_sweeps_run_on_our_op(scratch):
    venv = fresh_venv_with_pth(scratch)
    proc = nvme_tune(venv, scratch, enabled=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = {p.name: p.read_text() for p in (scratch / "logs").rglob("*") if p.is_file()}
    assert any("Read Speed" in text for text in logs.values()), logs
    assert any("Write Speed" in text for text in logs.values()), logs
    # The control: without the variable the same sweep reaches DeepSpeed's own op, whose build fails in the trap.
    failed = nvme_tune(venv, scratch, enabled=False)
    assert failed.returncode != 0
