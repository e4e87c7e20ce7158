"""fp16 autocast with ``torch.amp.GradScaler`` over streamed blocks (``training.scaling``).

Grads mode steps after the whole backward, so ``scaler.step(StreamedOptimizer(off))`` unscales and checks the blocks'
gradients where they are (storage, or memory when pinned) and skips an overflowing step before anything moves: the
losses, parameters, optimizer state, scale and skipped steps are those of the same loop in memory. Fused mode steps
inside backward and is refused before its first scaled step, naming grads mode.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepoffload import StreamOptions, TrainOptions
from deepoffload.errors import StreamedParameterError
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer
from deepoffload.swap.params import StreamedOptimizer, find_blocks, offload_parameters

harness = pytest.importorskip("tests.support.matrix_harness")

STEPS = 6


def _scaler() -> torch.amp.GradScaler:
    # grows every step, so it overflows within STEPS and backs off: skipped steps are part of the comparison
    return torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=1)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _loop(model, optimizer, scaler, clip=None, autocast=True, steps=STEPS):
    """Losses and the scale after each step; ``clip``: unscale, clip by the global norm, step (as Trainer does)."""
    out = []
    for k in range(steps):
        torch.manual_seed(100 + k)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = harness.loss_of(model(**harness.batch("plain", k % 3)))
        scaler.scale(loss).backward()
        if clip == "memory":
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        out.append((loss.item(), scaler.get_scale()))
    return out


def _skipped(history):
    return sum(1 for (_, before), (_, after) in zip(history, history[1:]) if after < before)


def _same_state(reference, off):
    got = off.state_dict()
    return all(torch.equal(v, got[k]) for k, v in reference.state_dict().items())


def _named_state(off=None, model=None, optimizer=None):
    """The optimizer state by parameter name (the matrix harness's reading), as comparable lists."""
    named = harness.Setup.optimizer_state(SimpleNamespace(off=off, model=model, optimizer=optimizer))
    return {n: {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for n, s in named.items()}


def _pinned(model):
    size = sum(p.numel() * p.element_size() for _, b in find_blocks(model) for p in b.parameters())
    return StreamOptions(max_resident_bytes=4 * size)


@pytest.mark.parametrize("variant", ["plain", "clip", "pinned"])
def test_fp16_autocast_with_a_grad_scaler_in_grads_mode_equals_memory(scratch, variant):
    """Same losses, scales (hence skipped steps), parameters and optimizer state as in memory; ``clip``: unscale_
    then clipping by the global norm (StreamedOptimizer(clip_grad_norm=)); ``pinned``: gradients kept in memory."""
    reference = harness.build("plain").train()
    optimizer = _adamw(reference.parameters())
    expected = _loop(reference, optimizer, _scaler(), clip="memory" if variant == "clip" else None)
    assert _skipped(expected) >= 1, "the loop must overflow at least once to test skipping"
    model = harness.build("plain").train()
    stream = _pinned(model) if variant == "pinned" else StreamOptions()
    off = offload_parameters(model, str(scratch), train=TrainOptions(_adamw, mode="grads"), stream=stream)
    try:
        streamed = StreamedOptimizer(off, clip_grad_norm=1.0 if variant == "clip" else None)
        assert _loop(model, streamed, _scaler()) == expected
        assert _same_state(reference, off)
        assert _named_state(off=off, model=model) == _named_state(model=reference, optimizer=optimizer)
    finally:
        off.close()


def test_a_grad_scaler_with_compute_dtype_in_grads_mode_equals_memory(scratch):
    """compute_dtype=torch.bfloat16 with a GradScaler (no autocast) never steps on scaled gradients: the scaler
    unscales the stored fp32 gradients, as in memory with bf16 compute copies."""
    reference = harness._compute_bf16_in_memory(harness.build("plain").train())
    expected = _loop(reference, _adamw(reference.parameters()), _scaler(), autocast=False)
    model = harness.build("plain").train()
    stream = StreamOptions(compute_dtype=torch.bfloat16)
    off = offload_parameters(model, str(scratch), train=TrainOptions(_adamw, mode="grads"), stream=stream)
    try:
        assert _loop(model, StreamedOptimizer(off), _scaler(), autocast=False) == expected
        assert _same_state(reference, off)
    finally:
        off.close()


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*.swp")}


def test_an_overflowing_step_changes_no_parameter_optimizer_state_or_swap_file(scratch):
    """DeepSpeed ZeRO-1/2's lesson: the overflow must be known before anything is written. A step whose scaled
    gradients overflow leaves the parameters, the optimizer state and every weight and optimizer-state swap file
    byte for byte as they were; the next step trains as in memory."""
    model = harness.build("plain").train()
    off = offload_parameters(model, str(scratch), train=TrainOptions(_adamw, mode="grads"))
    try:
        optimizer, scaler = StreamedOptimizer(off), _scaler()
        _loop(model, optimizer, scaler, steps=1)
        params, state, files = off.state_dict(), optimizer.state_dict(), _files(scratch)
        assert files, "weights and optimizer state are in swap files"
        scaler.update(new_scale=2.0**120)  # the next scaled backward overflows in float16
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = harness.loss_of(model(**harness.batch("plain", 1)))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == 2.0**119, "the step overflowed and was skipped"
        optimizer.zero_grad()
        assert _files(scratch) == files
        after = off.state_dict()
        assert all(torch.equal(params[k], after[k]) for k in params)
        again = optimizer.state_dict()["optimizers"]
        for mine, theirs in zip(again, state["optimizers"]):
            for key, value in theirs["state"].items():
                assert all(torch.equal(value[n], mine["state"][key][n]) for n in value)
    finally:
        off.close()


def test_fused_mode_refuses_the_first_scaled_step_and_its_advice_works(scratch):
    """Fused mode steps each block inside backward, before the scaler can unscale or skip: refused at the first
    scaler.scale(), naming grads mode, nothing stepped; grads mode then trains as in memory."""
    model = harness.build("plain").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    off = offload_parameters(model, str(scratch / "fused"), train=TrainOptions(_adamw, mode="fused"))
    with pytest.raises(StreamedParameterError, match='fused mode steps each block inside backward.*mode="grads"'):
        _loop(model, StreamedOptimizer(off), _scaler(), autocast=False, steps=1)
    state = off.state_dict()
    assert all(torch.equal(before[k], state[k]) for k in before if "running" not in k and "batches" not in k)
    off.close()
    reference = harness.build("plain").train()
    expected = _loop(reference, _adamw(reference.parameters()), _scaler(), autocast=False)
    model = harness.build("plain").train()
    with offload_parameters(model, str(scratch / "grads"), train=TrainOptions(_adamw, mode="grads")) as off:
        assert _loop(model, StreamedOptimizer(off), _scaler(), autocast=False) == expected
        assert _same_state(reference, off)


def test_a_scaler_unscaling_with_its_own_pass_is_refused_in_grads_mode(scratch):
    """A GradScaler subclass with its own _unscale_grads_ (torch's ShardedGradScaler) cannot reach the stored
    gradients: refused at scale(), naming torch.amp.GradScaler."""

    class OwnPass(torch.amp.GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    model = harness.build("plain").train()
    with offload_parameters(model, str(scratch), train=TrainOptions(_adamw, mode="grads")) as off:
        with pytest.raises(StreamedParameterError, match="OwnPass unscales.*torch.amp.GradScaler"):
            _loop(model, StreamedOptimizer(off), OwnPass("cpu"), steps=1)


def test_offloaded_optimizer_with_a_grad_scaler_equals_memory(scratch):
    """OffloadedOptimizer alone (state on storage, no step_in_backward) under fp16 autocast and a GradScaler: the
    scaler unscales the in-memory gradients and skips overflowing steps before the state is read."""
    reference = harness.build("plain").train()
    expected = _loop(reference, _adamw(reference.parameters()), _scaler())
    assert _skipped(expected) >= 1
    model = harness.build("plain").train()
    optimizer = OffloadedOptimizer(
        torch.optim.AdamW, list(model.parameters()), SwapConfig(folder=str(scratch)), lr=1e-2
    )
    try:
        assert _loop(model, optimizer, _scaler()) == expected
        assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))
    finally:
        optimizer.close()


def _trainer_run(model, folder: Path, kwargs: dict, steps: int = 6):
    """transformers' Trainer with ``fp16=True`` as it runs on an accelerator: accelerate makes no GradScaler and no
    fp16 autocast on a CPU, so its accelerator is given what it makes on a GPU (mixed precision "fp16", native AMP, a
    GradScaler): the forward runs under fp16 autocast, accelerator.backward scales the loss, the Trainer's grad-norm
    logging unscales (accelerator.clip_grad_norm_) and its AcceleratedOptimizer calls scaler.step/update."""
    import transformers
    from accelerate.state import AcceleratorState, GradientState

    data = [harness.batch("plain", k) for k in range(steps)]
    dataset = [{k: v[i] for k, v in b.items()} for b in data for i in range(2)]
    args = transformers.TrainingArguments(
        output_dir=str(folder),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        max_grad_norm=0.0,
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, **kwargs)
    accelerator = trainer.accelerator
    try:
        accelerator.state._mixed_precision, accelerator.native_amp = "fp16", True
        scaler = accelerator.scaler = _scaler()
        scales: list[float] = []
        record = type(
            "Scales",
            (transformers.TrainerCallback,),
            {"on_step_end": lambda *a, **k: scales.append(scaler.get_scale())},
        )
        trainer.add_callback(record())
        trainer.train()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log], scales


@pytest.mark.parametrize("steps", [5, 6])
def test_trainer_fp16_in_grads_mode_equals_memory(scratch, steps):
    """The Trainer's own fp16 (autocast, loss scaling, unscaling for its grad-norm log, scaler.step) over a streamed
    model in grads mode: same losses, scales, skipped steps (the 4th or 5th overflows) and parameters as in memory.
    With 6 steps, steps follow the skipped one: the Trainer drops gradients with model.zero_grad(), which did not reach
    the blocks' stored ones, so the skipped step's unscaled gradients were added to the next step's (parameters 1e-7
    apart); trainer_arguments' callback now drops them at each step's end."""
    from deepoffload import trainer_arguments

    reference = harness.build("plain").train()
    optimizer = _adamw(reference.parameters())
    expected = _trainer_run(reference, scratch / "memory", {"optimizers": (optimizer, None)}, steps)
    assert _skipped([(None, s) for s in expected[1]]) >= 1, "a step overflows and is skipped"
    model = harness.build("plain").train()
    with offload_parameters(model, str(scratch / "swap"), train=TrainOptions(_adamw, mode="grads")) as off:
        assert _trainer_run(model, scratch / "streamed", trainer_arguments(off), steps) == expected
        assert _same_state(reference, off)


def test_a_backward_onto_gradients_a_skipped_step_left_is_refused(scratch):
    """After a step the scaler skipped, the stored gradients stay until zero_grad(); model.zero_grad() does not reach
    them where no block is in memory (where one is, it raises; in the Trainer, trainer_arguments' callback drops them),
    so they would be added to the next backward's. A backward before step() or zero_grad() is refused, naming
    opt.zero_grad(); with it the loop goes on (and equals memory: the other tests)."""
    model = harness.build("plain").train()
    with offload_parameters(model, str(scratch), train=TrainOptions(_adamw, mode="grads")) as off:
        optimizer, scaler = StreamedOptimizer(off), _scaler()
        _loop(model, optimizer, scaler, steps=1)
        scaler.update(new_scale=2.0**120)  # overflows in float16: the next step is skipped

        def scaled_backward():
            torch.manual_seed(1)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = harness.loss_of(model(**harness.batch("plain", 1)))
            scaler.scale(loss).backward()

        scaled_backward()
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == 2.0**119, "skipped"
        # no opt.zero_grad() here (model.zero_grad() on blocks all on storage does as little)
        with pytest.raises(StreamedParameterError, match=r"model.zero_grad\(\) does not reach.*zero_grad"):
            scaled_backward()
        optimizer.zero_grad()  # the advice: then the loop goes on
        scaled_backward()
