"""The warning ``enable()`` adds to ``DeepSpeedEngine.load_checkpoint``: DeepSpeed 0.19.8 resumes a checkpoint with
the optimizer state on NVMe without that state (Adam restarts), and says nothing. Checked on stand-ins for the engine
and its method (no training); the real resume is in tests/integrations/test_deepspeed_integration.py."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

from deepoffload.integrations.deepspeed import warn_on_nvme_optimizer_resume


class Engine:
    """Stands in for a DeepSpeedEngine: only what the wrapper reads."""

    def __init__(self, nvme: bool):
        self.nvme = nvme
        self.calls = []

    def zero_nvme_offload_optimizer(self):
        return self.nvme


def original(
    self,
    load_dir,
    tag=None,
    load_module_strict=True,
    load_optimizer_states=True,
    load_lr_scheduler_states=True,
    load_module_only=False,
    custom_load_fn=None,
):
    """DeepSpeed's signature; returns (None, None) where no checkpoint is found, as DeepSpeed's does."""
    self.calls.append((load_dir, tag, load_optimizer_states, load_module_only))
    return (None, None) if load_dir == "missing" else (f"{load_dir}/{tag}", {"client": 1})


load_checkpoint = warn_on_nvme_optimizer_resume(original)


def call(engine, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load_checkpoint(engine, *args, **kwargs)
    return result, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_warns_once_after_the_load_when_nvme_optimizer_state_is_asked_for():
    engine = Engine(nvme=True)
    result, messages = call(engine, "ckpt", tag="t")
    assert result == ("ckpt/t", {"client": 1}) and engine.calls == [("ckpt", "t", True, False)]
    assert len(messages) == 1
    message = messages[0]
    assert "'ckpt/t'" in message and "parameters are restored" in message and "Adam restarts" in message
    assert "moments and step count are not" in message and "keep it off NVMe" in message
    assert call(engine, "ckpt", "t", True, True)[1] == messages  # the same asked for positionally


@pytest.mark.parametrize(
    "nvme, args, kwargs",
    [
        (False, ("ckpt", "t"), {}),  # optimizer state not on NVMe: DeepSpeed loads it
        (True, ("ckpt", "t"), {"load_optimizer_states": False}),
        (True, ("ckpt", "t", True, False), {}),  # load_optimizer_states=False positionally
        (True, ("ckpt", "t"), {"load_module_only": True}),
        (True, ("missing",), {}),  # nothing loaded
    ],
)
def test_no_warning_otherwise(nvme, args, kwargs):
    engine = Engine(nvme)
    result, messages = call(engine, *args, **kwargs)
    assert messages == [] and len(engine.calls) == 1
    assert result == ((None, None) if args[0] == "missing" else ("ckpt/t", {"client": 1}))


def test_errors_of_the_original_pass_through_without_a_warning():
    with pytest.raises(TypeError):
        call(Engine(nvme=True))  # load_dir missing


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_enable_installs_and_disable_removes_it(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    from deepspeed.runtime.engine import DeepSpeedEngine

    from deepoffload.integrations import deepspeed as integration

    theirs = DeepSpeedEngine.load_checkpoint
    assert not integration.enabled()
    integration.enable()
    try:
        ours = DeepSpeedEngine.load_checkpoint
        assert getattr(ours, "deepoffload", False) and ours.__wrapped__ is theirs
        integration.enable()  # idempotent: not wrapped twice
        assert DeepSpeedEngine.load_checkpoint is ours
    finally:
        integration.disable()
    assert DeepSpeedEngine.load_checkpoint is theirs and "load_checkpoint" in vars(DeepSpeedEngine)
    integration.disable()
    assert DeepSpeedEngine.load_checkpoint is theirs
