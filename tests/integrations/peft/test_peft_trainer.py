"""LoRA over a served base in transformers' ``Trainer``, with a checkpoint at step 2 and a resumed run: the losses and
the adapters are bit-identical to the same ``Trainer`` run on transformers' in-memory model."""

from __future__ import annotations

import pytest
import torch

from deepoffload import trainer_arguments
from tests.integrations.peft import served as s

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _trainer(model, out, **kwargs):
    data = [s.batch(k) for k in range(s.STEPS)]
    dataset = [{k: v[i] for k, v in b.items()} for b in data for i in range(2)]
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=s.STEPS,
        per_device_train_batch_size=2,
        learning_rate=s.LR,
        save_steps=2,
        save_strategy="steps",
        logging_steps=1,
        report_to=[],
        max_grad_norm=0.0,
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=dataset, **kwargs)


def _run(make, out):
    """Three steps, then a fresh model resumed from the step-2 checkpoint: (losses of both, adapters at the end)."""
    model, kwargs, close = make("first")
    first = _trainer(model, out, **kwargs)
    first.train()
    losses = [log["loss"] for log in first.state.log_history if "loss" in log]
    ended = s.adapters(model)
    close()
    model, kwargs, close = make("resumed")
    second = _trainer(model, out, **kwargs)
    second.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    losses += [log["loss"] for log in second.state.log_history if "loss" in log]
    resumed = s.adapters(model)
    close()
    return losses, ended, resumed


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_lora_over_a_served_base_in_trainer_with_resume_is_bit_identical(tmp_path, mode):
    folder = s.save_base(tmp_path / "base")

    def in_memory(_):
        model = s.in_memory(folder)
        optimizer = s.adam([p for p in model.parameters() if p.requires_grad])
        return model, {"optimizers": (optimizer, None)}, lambda: None

    def streamed(name):
        model, off = s.served(folder, tmp_path / f"swap-{name}", mode)
        return model, trainer_arguments(off), off.close

    expected = _run(in_memory, tmp_path / "memory")
    got = _run(streamed, tmp_path / "streamed")
    # 3 steps; the resumed run's history: steps 1-2 from the checkpoint, then its own step 3
    assert len(got[0]) == 6 and got[0] == expected[0]
    for ours, theirs in zip(got[1:], expected[1:]):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert all(torch.equal(got[1][k], got[2][k]) for k in got[1])  # the resumed run ended where the first did
