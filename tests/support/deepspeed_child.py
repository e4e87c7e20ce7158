"""Child process for tests/integrations/test_deepspeed_integration.py: DeepSpeed ZeRO-3 on deepoffload's op, one
process, gloo.

Usage: python deepspeed_child.py MODE FOLDER [STEPS]; MODE is optimizer (offload_optimizer to NVMe), param (and
offload_param too), resume_save (as optimizer, then a checkpoint saved and resumed into a second engine in the
same process), resume_load (that checkpoint resumed in a fresh process) or fast_checkpoint (saved by
DeepSpeed's fast checkpoint writer and resumed; then torch.save through its FastFileWriter). Each trains against
ZeRO-3 in memory where it compares. Prints one JSON line with the results. DeepSpeed's own op builders refuse to
build or load, unless DEEPOFFLOAD_CHILD_OP=deepspeed: then DeepSpeed's own async_io op runs (already built).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import deepspeed
import torch
from deepspeed.ops.op_builder.builder import OpBuilder


def refuse(self, *args, **kwargs):
    raise RuntimeError(f"DeepSpeed tried to build or load its own op {self.name!r}")


# Its CPU backend would build a shared-memory comm op for one process; gloo alone does (and builds nothing).
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
if os.environ.get("DEEPOFFLOAD_CHILD_OP") != "deepspeed":
    OpBuilder.load = refuse
    OpBuilder.jit_load = refuse
    OpBuilder.builder = refuse

    from deepoffload.integrations import deepspeed as integration

    integration.enable()


WIDTH = 640  # each weight 1.6 MB: DeepSpeed swaps only tensors of at least 1 MiB


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)], torch.nn.Linear(WIDTH, 1))


def config(folder: str | None, offload_param: bool) -> dict:
    aio = {
        "block_size": 1 << 20,
        "queue_depth": 8,
        "intra_op_parallelism": 2,
        "single_submit": False,
        "overlap_events": True,
    }
    zero = {"stage": 3}
    if folder is not None:  # None: ZeRO-3 in memory, the reference
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": folder, "pin_memory": True, "buffer_count": 4}
    if offload_param:
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": folder,
            "pin_memory": True,
            "buffer_count": 8,
            "buffer_size": 1 << 19,
            "max_in_cpu": 0,
        }
        zero.update(
            stage3_max_reuse_distance=0,
            stage3_prefetch_bucket_size=0,
            stage3_max_live_parameters=500_000,
            stage3_param_persistence_threshold=0,
        )
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "aio": aio,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


def engine_for(
    folder: str | None, offload_param: bool, fast_writer: bool = False, initial: list[torch.Tensor] | None = None
):
    """A ZeRO-3 engine (optimizer state on NVMe under ``folder`` unless it is None; parameters too with
    ``offload_param``) on the model of make_model(), or with the parameter values ``initial``."""
    cfg = config(folder, offload_param)
    if offload_param:  # parameters are placed on NVMe as they are created
        deepspeed.init_distributed(dist_backend="gloo")
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
            model = make_model()
    else:
        model = make_model()
    if initial is not None:
        with torch.no_grad():
            for p, value in zip(model.parameters(), initial):
                p.copy_(value)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if fast_writer:  # DeepSpeed's fast checkpoint writer: its FastFileWriter on an aio handle
        cfg["checkpoint"] = {"writer": {"type": "fast", "io_buffer_size": 1 << 16, "io_buffer_double": True}}
        cfg["aio"]["use_gds"] = False
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    return engine


def train(engine, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, WIDTH, generator=gen)
        y = torch.randn(4, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_params(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def main() -> None:
    mode, folder = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    out: dict = {"mode": mode}
    if mode in ("optimizer", "param", "resume_save"):
        # Trained on NVMe against ZeRO-3 in memory. resume_save (optimizer state on NVMe) then saves a checkpoint:
        # DeepSpeed copies the swap files into it, and the fp32 partition there must be exactly the engine's
        # parameters; then 3 more steps; then a second engine built in this same process resumes (resume_load
        # resumes in a fresh one).
        swap_folder = folder + "/first" if mode == "resume_save" else folder
        engine = engine_for(swap_folder, mode == "param")
        initial = full_params(engine)
        out["losses"] = train(engine, steps)
        out["handle_types"] = sorted({type(h).__module__ for h in _handles(engine)})
        swapped = [p for p in Path(swap_folder).rglob("*.swp") if p.stat().st_size > 0]  # removed with the engine
        out["optimizer_swap_files"] = sum("optimizer" in str(p) for p in swapped)
        out["param_swap_files"] = sum(p.name.endswith("_param.tensor.swp") for p in swapped)
        reference = engine_for(None, False)
        out["reference_losses"] = train(reference, steps)
        ours, theirs = full_params(engine), full_params(reference)
        out["params_match_reference"] = all(torch.equal(a, b) for a, b in zip(ours, theirs))
        out["params_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
        out["params_moved"] = max(float((a - b).abs().max()) for a, b in zip(ours, initial))
        if mode == "resume_save":
            out.update(_save_and_resume(engine, ours, folder))
    elif mode == "resume_load":
        # A fresh process (as a real resume is) builds the engine again, loads the checkpoint, goes on 3 steps.
        out.update(_resume(folder, "fresh_process"))
    elif mode == "fast_checkpoint":
        # DeepSpeed's fast checkpoint writer (on our op) saves; a fresh engine resumes: bit-identical continuation.
        # Resumed with DeepSpeed's default (torch) checkpoint engine: its fast engine's load() calls torch.load with
        # torch's weights_only=True default, which refuses DeepSpeed's own checkpoints under torch >= 2.6.
        global WIDTH
        WIDTH = 64  # small enough that nothing is swapped: the resumed engine's state is all in the checkpoint
        if not torch.cuda.is_available():  # as in fast_writer()
            torch.Tensor.pin_memory = lambda self, device=None: self
        engine = engine_for(None, False, fast_writer=True)
        train(engine, steps)
        saved = full_params(engine)
        engine.save_checkpoint(folder + "/ckpt", tag="t")
        out["writer_handle_type"] = type(engine.checkpoint_engine._writer._dnvme_handle).__module__
        after = train(engine, 3, seed=7)
        resumed = engine_for(None, False)
        resumed.load_checkpoint(folder + "/ckpt", tag="t")
        out["params_restored"] = all(torch.equal(a, b) for a, b in zip(saved, full_params(resumed)))
        again = train(resumed, 3, seed=7)
        out["losses_after_save"], out["losses_after_resume"] = after, again
        out["params_equal"] = all(torch.equal(a, b) for a, b in zip(full_params(engine), full_params(resumed)))
        out.update(fast_writer(folder))
    print(json.dumps(out))


def _save_and_resume(engine, saved: list[torch.Tensor], folder: str) -> dict:
    out = {"ids": sorted(str(g.ds_id) for g in engine.optimizer.fp32_partitioned_groups_flat)}
    torch.save(saved, folder + "/saved.pt")
    engine.save_checkpoint(folder + "/ckpt", tag="t")
    swapped = [
        p
        for p in Path(folder, "ckpt", "t", "offloaded_tensors").rglob("*.tensor.swp")
        if "gradient" not in p.name and "-" not in p.name
    ]
    out["fp32_files"] = len(swapped)
    flat = torch.cat([p.reshape(-1) for p in saved])
    data = torch.frombuffer(bytearray(swapped[0].read_bytes()), dtype=torch.float32) if swapped else None
    out["fp32_in_checkpoint_equal"] = data is not None and torch.equal(data[: flat.numel()], flat)
    out["state_files"] = sum(1 for p in Path(folder, "ckpt").rglob("exp_avg*.tensor.swp") if p.stat().st_size)
    out["losses_after_save"] = train(engine, 3, seed=7)
    torch.save(full_params(engine), folder + "/after.pt")
    out.update(_resume(folder, "same_process"))
    return out


def _resume(folder: str, name: str) -> dict:
    """Builds an engine with its optimizer state on NVMe (own swap folder), loads the checkpoint ``resume_save``
        wrote, and compares its parameters and 3 further steps with those of the engine that saved it, and with ZeRO-3
        in memory started from the saved parameters with a fresh Adam (no moments, step 0); records the UserWarnings
    ``load_checkpoint`` emitted."""
    engine = engine_for(f"{folder}/{name}", False)
    ids = sorted(str(g.ds_id) for g in engine.optimizer.fp32_partitioned_groups_flat)
    with warnings.catch_warnings(record=True) as caught:  # enable()'s warning that Adam restarts
        warnings.simplefilter("always")
        engine.load_checkpoint(folder + "/ckpt", tag="t")
    load_warnings = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    saved, after = torch.load(folder + "/saved.pt"), torch.load(folder + "/after.pt")
    restored = all(torch.equal(a, b) for a, b in zip(saved, full_params(engine)))
    state_entries = len(engine.optimizer.optimizer.state)  # Adam's moments and step count, as loaded
    losses = train(engine, 3, seed=7)
    params = full_params(engine)
    out = {
        "ids": ids,
        "load_warnings": load_warnings,
        "params_restored": restored,
        "optimizer_state_entries": state_entries,
        "losses": losses,
        "params_equal_continued": all(torch.equal(a, b) for a, b in zip(after, params)),
    }
    if restored:
        fresh = engine_for(None, False, initial=saved)
        out["losses_fresh_adam"] = train(fresh, 3, seed=7)
        out["params_max_abs_diff_fresh_adam"] = max(
            float((a - b).abs().max()) for a, b in zip(params, full_params(fresh))
        )
    return {f"{name}_{key}": value for key, value in out.items()}


def fast_writer(folder: str) -> dict:
    """torch.save through DeepSpeed's FastFileWriter (made by its checkpoint writer factory), then torch.load."""
    from deepspeed.runtime.model_checkpointing.writer_factory import CheckpointWriterFactory

    if not torch.cuda.is_available():  # DeepSpeed's factory calls Tensor.pin_memory(), which CPU-only torch refuses
        torch.Tensor.pin_memory = lambda self, device=None: self

    aio = {
        "block_size": 1 << 20,
        "queue_depth": 8,
        "intra_op_parallelism": 2,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    }
    writer = {
        "type": "FAST",
        "io_buffer_size": 1 << 16,
        "io_buffer_double": True,
        "io_multiplier": 1,
        "show_statistics": False,
    }
    import types

    factory = CheckpointWriterFactory(writer, aio, types.SimpleNamespace(global_rank=0, rank=0, world_size=1))
    torch.manual_seed(3)
    state = {
        "a": torch.randn(100_003),
        "b": torch.arange(77, dtype=torch.int16),
        "c": [torch.randn(5, 7)] * 2,
        "d": "text",
    }
    results = {"handle_type": type(factory._dnvme_handle).__module__}
    path = folder + "/fast.pt"
    torch.save(state, factory.create_writer(path, False))
    factory.release_writer()
    loaded = torch.load(path, weights_only=False)
    results["loaded_equal"] = (
        torch.equal(loaded["a"], state["a"])
        and torch.equal(loaded["b"], state["b"])
        and all(torch.equal(x, y) for x, y in zip(loaded["c"], state["c"]))
        and loaded["d"] == "text"
    )
    return results


def _handles(engine):
    """The aio handles DeepSpeed's swappers hold."""
    found = []
    opt = engine.optimizer
    for holder in (getattr(opt, "optimizer_swapper", None), getattr(opt, "param_swapper", None)):
        for name in ("aio_handle", "aio_read_handle", "aio_write_handle", "write_aio_handle", "read_aio_handle"):
            h = getattr(holder, name, None)
            if h is not None and not isinstance(h, type):
                found.append(h)
    for module in engine.module.modules():
        for p in module.parameters(recurse=False):
            swapper = getattr(p, "nvme_swapper", None)
            if swapper is not None:
                found += [swapper.aio_read_handle, swapper.aio_write_handle]
    return found


if __name__ == "__main__":
    main()
