"""Train a model with its optimizer state on storage (``deepoffload.OffloadedOptimizer``), save and resume a
checkpoint, and check the run against the same training in memory: losses and parameters are bit-identical.

    python examples/optimizer_offload.py [--folder /nvme] [--steps 20] [--width 1024] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

import deepoffload


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 1),
    )


def batches(steps: int, width: int):
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        yield torch.randn(16, width, generator=generator)


def train(model, opt, sched, data) -> list[float]:
    losses = []
    for batch in data:
        loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", default=None, help="where the state goes (your NVMe); default: a temp folder")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024, help="hidden width (AdamW state: 8 bytes per weight)")
    parser.add_argument("--tiny", action="store_true", help="a few seconds: width 64, 4 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.steps = 64, 4
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or scratch
        # --8<-- [start:quickstart]
        model = make_model(args.width)
        opt = deepoffload.OffloadedOptimizer(
            torch.optim.AdamW, model.parameters(), lr=1e-3, config=deepoffload.SwapConfig(folder=folder)
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, 10)
        losses = train(model, opt, sched, batches(args.steps, args.width))  # each step reads, steps, writes back
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
        deepoffload.save(state, f"{scratch}/ckpt.pt")  # opt.state_dict() holds the real state, read from storage
        print(f"{opt.stored_bytes():,} bytes of optimizer state on storage")
        opt.close()  # removes its swap files
        # --8<-- [end:quickstart]

        reference = make_model(args.width)
        plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        plain_sched = torch.optim.lr_scheduler.StepLR(plain, 10)
        expected = train(reference, plain, plain_sched, batches(args.steps, args.width))
        same = losses == expected and all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
        print(f"losses and parameters identical to training in memory: {'yes' if same else 'NO'}")

        # resume: load_state_dict writes the checkpoint's state back to storage
        state = deepoffload.load(f"{scratch}/ckpt.pt")
        resumed = make_model(args.width)
        resumed.load_state_dict(state["model"])
        opt = deepoffload.OffloadedOptimizer(
            torch.optim.AdamW, resumed.parameters(), lr=1e-3, config=deepoffload.SwapConfig(folder=folder)
        )
        opt.load_state_dict(state["optimizer"])
        sched = torch.optim.lr_scheduler.StepLR(opt, 10)
        sched.load_state_dict(state["scheduler"])
        more = train(resumed, opt, sched, batches(2, args.width))
        opt.close()
        more_expected = train(reference, plain, plain_sched, batches(2, args.width))
        resumed_same = more == more_expected and all(
            torch.equal(a, b) for a, b in zip(resumed.parameters(), reference.parameters())
        )
        print(f"resumed training identical to continuing in memory: {'yes' if resumed_same else 'NO'}")
    return 0 if same and resumed_same else 1


if __name__ == "__main__":
    sys.exit(main())
