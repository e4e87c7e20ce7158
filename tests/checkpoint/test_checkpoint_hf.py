"""The Hugging Face Trainer recipe of docs/guides/checkpoints.md: optimizer and scheduler states written by
deepoffload.save, read back by the Trainer's own torch.load when resuming, with the same result as an uninterrupted
run."""

from __future__ import annotations

import os

import pytest
import torch

import deepoffload
from deepoffload.checkpoint import api

transformers = pytest.importorskip("transformers")


class FastCheckpointTrainer(transformers.Trainer):  # the recipe in docs/guides/checkpoints.md
    def _save_optimizer_and_scheduler(self, output_dir):
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not self.args.should_save:
            return super()._save_optimizer_and_scheduler(output_dir)
        deepoffload.save(self.optimizer.state_dict(), os.path.join(output_dir, "optimizer.pt"))
        deepoffload.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        out = self.linear(x).squeeze(-1)
        return {"loss": (out - labels).square().mean(), "logits": out}


def data():
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(8, generator=g), "labels": torch.randn((), generator=g)} for _ in range(32)]


def train(output_dir, max_steps, resume=None):
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        save_steps=2,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = FastCheckpointTrainer(model=Tiny(), args=args, train_dataset=data())
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model.linear.weight.detach().clone()


@pytest.mark.slow  # importing transformers takes about 30 s here
def test_trainer_recipe_writes_with_deepoffload_and_resumes_identically(tmp_path, monkeypatch):
    written = []
    write_file = api._write_file

    def recording(records, path, *args):
        written.append(os.path.basename(path))
        return write_file(records, path, *args)

    monkeypatch.setattr(api, "_write_file", recording)
    full = train(tmp_path / "a", 4)
    assert written.count("optimizer.pt") == 2 and written.count("scheduler.pt") == 2  # steps 2 and 4
    resumed = train(tmp_path / "b", 4, resume=str(tmp_path / "a" / "checkpoint-2"))
    assert torch.equal(full, resumed)
