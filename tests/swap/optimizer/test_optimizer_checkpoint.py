"""Checkpoints: save model + offloaded optimizer + scheduler with torch.save, restart in a new process, load, resume:
identical, bit for bit, to uninterrupted training in memory."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

STEPS_BEFORE, STEPS_AFTER = 6, 6


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.GELU(), torch.nn.Linear(40, 5))
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.004}]
    return model, groups


def train(model, optimizer, scheduler, start, steps):
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(10, 12, generator=g), torch.randn(10, 5, generator=g)
        optimizer.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def offloaded(folder):
    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

    model, groups = make()
    optimizer = OffloadedOptimizer(
        torch.optim.AdamW, groups, SwapConfig(folder=folder, chunk_bytes=4096), lr=0.01, amsgrad=True
    )
    return model, optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)


def phase(name: str, folder: str, checkpoint: str) -> None:
    """Run in a fresh process: 'before' trains and saves a checkpoint, 'after' loads it and trains on."""
    model, optimizer, scheduler = offloaded(folder)
    if name == "before":
        losses = train(model, optimizer, scheduler, 0, STEPS_BEFORE)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "losses": losses,
            },
            checkpoint,
        )
    else:
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        losses = saved["losses"] + train(model, optimizer, scheduler, STEPS_BEFORE, STEPS_AFTER)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "losses": losses}, checkpoint)
    optimizer.close()


@pytest.mark.slow
def test_resume_in_a_new_process_is_identical(scratch, tmp_path):
    checkpoint = str(tmp_path / "checkpoint.pt")
    for name in ("before", "after"):
        subprocess.run([sys.executable, __file__, name, str(scratch), checkpoint], check=True, timeout=120)
    resumed = torch.load(checkpoint)

    model, groups = make()
    optimizer = torch.optim.AdamW(groups, lr=0.01, amsgrad=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    losses = train(model, optimizer, scheduler, 0, STEPS_BEFORE + STEPS_AFTER)

    assert resumed["losses"] == losses
    for key, value in model.state_dict().items():
        assert torch.equal(resumed["model"][key], value), key
    expected = optimizer.state_dict()
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed["optimizer"]["state"][index][key], value), (index, key)
    assert [name for name in scratch.iterdir() if name.name.startswith("deepoffload-")] == []


if __name__ == "__main__":
    phase(*sys.argv[1:])
