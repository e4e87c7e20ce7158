"""The Hugging Face Trainer with ``optimizers=(OffloadedOptimizer(...), scheduler)`` on a tiny Llama built from a
config (no download): logged losses and final parameters identical to the in-memory Trainer (gradient clipping,
linear schedule, weight decay), and a resume from a Trainer checkpoint identical to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from deepoffload.swap.config import SwapConfig  # noqa: E402
from deepoffload.swap.optimizer import OffloadedOptimizer  # noqa: E402

STEPS = 6


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 48, length: int = 16):
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 97, (count, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run(folder, offload_folder=None, resume=None, max_steps=STEPS, in_backward=False, max_grad_norm=1.0):
    model = tiny_llama()
    groups = [
        {"params": [p for n, p in model.named_parameters() if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if p.dim() <= 1], "weight_decay": 0.0},
    ]
    if offload_folder is None:
        optimizer = torch.optim.AdamW(groups, lr=3e-3)
    else:  # small chunks: each step walks many chunks
        config = SwapConfig(folder=str(offload_folder), chunk_bytes=64 << 10, buffer_count=3)
        optimizer = OffloadedOptimizer(torch.optim.AdamW, groups, config, lr=3e-3)
        if in_backward:
            optimizer.step_in_backward()
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, STEPS)
    args = transformers.TrainingArguments(
        output_dir=str(folder),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_grad_norm=max_grad_norm,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(optimizer, scheduler))
    trainer.train(resume_from_checkpoint=resume)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if offload_folder is not None:
        assert optimizer.stored_bytes() > 0
        optimizer.close()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_trainer_losses_and_parameters_identical_and_resume_identical(tmp_path, scratch):
    expected_losses, expected_params = run(tmp_path / "memory")
    losses, params = run(tmp_path / "offloaded", scratch)
    assert len(losses) == STEPS and losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params))
    # resume from the checkpoint of step 3 (optimizer state saved through state_dict, loaded back to storage)
    checkpoint = tmp_path / "offloaded" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").exists()
    resumed_losses, resumed = run(tmp_path / "resumed", scratch, resume=str(checkpoint))
    assert resumed_losses[-3:] == expected_losses[3:]  # steps 4-6, computed after the resume
    assert all(torch.equal(a, b) for a, b in zip(resumed, expected_params))


@pytest.mark.slow
def test_step_in_backward_is_refused_under_the_trainer_before_any_parameter_moves(tmp_path, scratch):
    """The Trainer calls clip_grad_norm_ at every step (with an infinite norm when max_grad_norm=0, to log the norm):
    its multiplication by 1.0 changes the gradients' versions, so step_in_backward is refused at the first step."""
    from deepoffload.errors import UnsupportedError

    before = [p.detach().clone() for p in tiny_llama().parameters()]
    model_params = []
    original = transformers.Trainer.train

    def train(self, *args, **kwargs):
        model_params.extend(self.model.parameters())
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.Trainer, "train", train)
        with pytest.raises(UnsupportedError, match="changed between backward and step.*nothing was stepped"):
            run(tmp_path / "in_backward", scratch, in_backward=True, max_grad_norm=0.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model_params))
