"""DeepSpeed ZeRO-3 with the optimizer state on NVMe (ZeRO-Infinity), running on deepoffload's async-IO op:
``deepoffload.integrations.deepspeed.enable()`` before ``deepspeed.initialize``, so DeepSpeed never builds its own
op. Trains a few steps and checks the losses against ZeRO-3 in memory.

One process here (gloo, ``DS_ACCELERATOR=cpu`` when there is no GPU); launch with ``deepspeed`` or ``torchrun``
as usual for more.

    python examples/deepspeed_zero3.py [--folder /nvme] [--steps 5] [--width 1024] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

import torch


def single_process_environment() -> None:
    """What a launcher would set, for one process on this machine."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_SIZE": "1",
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
    }.items():
        os.environ.setdefault(key, value)


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)], torch.nn.Linear(width, 1))


def config(folder: str | None) -> dict:
    zero: dict = {"stage": 3}
    if folder is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": folder, "pin_memory": True, "buffer_count": 4}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": zero,
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1000,
    }


def train(folder: str | None, width: int, steps: int) -> list[float]:
    import deepspeed

    model = make_model(width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(folder))
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, width, generator=generator), torch.randn(4, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", default=None, help="DeepSpeed's nvme_path (your NVMe); default: a temp folder")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024, help="DeepSpeed swaps only tensors of 1 MiB and more")
    parser.add_argument("--tiny", action="store_true", help="a few seconds: width 640 (weights of 1.6 MB), 3 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.steps = 640, 3
    single_process_environment()
    # --8<-- [start:quickstart]
    import deepspeed

    import deepoffload.integrations.deepspeed as dso

    dso.enable()  # DeepSpeed's swappers and fast checkpoint writer now run on deepoffload's op
    # --8<-- [end:quickstart]
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        # one CPU process: gloo alone communicates; DeepSpeed's CPU backend would build a shared-memory op for it
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if os.environ.get("DS_ACCELERATOR") == "cpu" else "nccl")
    with tempfile.TemporaryDirectory() as scratch:
        losses = train(args.folder or scratch, args.width, args.steps)
    expected = train(None, args.width, args.steps)
    print(f"losses with the optimizer state on NVMe: {[round(x, 6) for x in losses]}")
    same = losses == expected
    print(f"identical to ZeRO-3 in memory: {'yes' if same else 'NO'}")
    dso.disable()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
