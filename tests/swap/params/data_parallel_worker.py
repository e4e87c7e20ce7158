"""One rank of tests/swap/params/test_data_parallel.py, started by torchrun (gloo, CPU): data-parallel streaming
(``TrainOptions(optimizer, data_parallel=True)``) trained against DistributedDataParallel in memory on the same
data, in fused mode and in grads mode (two micro-batches per step, clipping by the global norm), with an evaluation
on the first rank alone after the second step (``ddp.module`` / ``off.rank_local()``).

Usage: torchrun ... data_parallel_worker.py OUT_FOLDER SWAP_BASE. Each rank starts from its own random model (DDP and
data-parallel streaming both take rank 0's), trains on its own data (fused mode with data_parallel=True, grads mode
with a ProcessGroup), and writes OUT_FOLDER/rank<R>.json. The swap
files of a rank go under SWAP_BASE/node<GROUP_RANK>/local<LOCAL_RANK> (one folder per node and local rank, as one
NVMe per local device would be), which must be empty again after close()."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from deepoffload import StreamOptions, TrainOptions, offload_parameters

WIDTH, STEPS, LR = 16, 4, 1e-2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
            for _ in range(3)
        )
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def model_of(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 1, generator=gen)) for _ in range(count)]


def adam(params):
    return torch.optim.Adam(params, lr=LR)


def train_ddp(rank: int, micro: int, clip: float | None) -> tuple[list[float], dict]:
    model = DistributedDataParallel(model_of(rank))  # DDP broadcasts rank 0's values
    optimizer = adam(model.parameters())
    data = batches(rank, STEPS * micro)
    losses = []
    for step in range(STEPS):
        for x, y in data[step * micro : (step + 1) * micro]:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # DDP reduces every backward (no no_sync), the accumulated grads included
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and step == 1:  # evaluation on the first rank alone, through ddp.module (no collective)
            losses.append(evaluate(model.module, data[0]))
    return losses, {k: v.clone() for k, v in model.module.state_dict().items()}


def evaluate(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(batch[0]), batch[1]).item()
    model.train()
    return loss


def train_streamed(
    rank: int, mode: str, micro: int, clip: float | None, folder: Path, group
) -> tuple[list[float], dict]:
    model = model_of(rank)  # data_parallel= broadcasts rank 0's values
    # grads mode: the first block held in memory (max_resident_bytes), its averaged gradients kept there too
    off = offload_parameters(
        model,
        str(folder),
        train=TrainOptions(mode=mode, optimizer=adam, data_parallel=group),
        stream=StreamOptions(max_resident_bytes=3000 if mode == "grads" else None),
    )
    assert len(off.pinned) == (1 if mode == "grads" else 0), off.pinned
    runs = [p.name for p in folder.iterdir()]
    assert runs and all(name.startswith(f"deepoffload-rank{rank}-") for name in runs), runs
    data = batches(rank, STEPS * micro)
    losses = []
    for step in range(STEPS):
        for x, y in data[step * micro : (step + 1) * micro]:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
        off.step(clip_grad_norm=clip)
        off.zero_grad()
        if rank == 0 and step == 1:  # the same, inside rank_local(): without it the buffer broadcast waits for rank 1
            with off.rank_local():
                losses.append(evaluate(model, data[0]))
    state = off.state_dict()
    off.close()
    return losses, state


def main() -> None:
    out, swap_base = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = swap_base / f"node{os.environ['GROUP_RANK']}" / f"local{os.environ['LOCAL_RANK']}"
    folder.mkdir(parents=True, exist_ok=True)
    result: dict = {"rank": rank, "world": dist.get_world_size(), "node": int(os.environ["GROUP_RANK"])}
    every_rank = dist.new_group(list(range(dist.get_world_size())))  # a ProcessGroup given, as well as True
    for name, mode, micro, clip, group in (("fused", "fused", 1, None, True), ("grads", "grads", 2, 0.05, every_rank)):
        ref_losses, ref_state = train_ddp(rank, micro, clip)
        losses, state = train_streamed(rank, mode, micro, clip, folder, group)
        result[name] = {
            "losses_equal": losses == ref_losses,
            "state_equal": sorted(ref_state) == sorted(state)
            and all(torch.equal(ref_state[k], state[k]) for k in ref_state),
            "max_abs_diff": max(float((ref_state[k].float() - state[k].float()).abs().max()) for k in ref_state),
            "moved": max(
                float((ref_state[k].float() - model_of(0).state_dict()[k].float()).abs().max())
                for k in ref_state
                if k.endswith("weight")
            ),
            "left_in_swap_folder": sorted(p.name for p in folder.iterdir()),
        }
    # every rank holds the same trained parameters, as DDP keeps them (BatchNorm statistics are each rank's own)
    names = [n for n, _ in Net().named_parameters()]
    flat = torch.cat([state[n].reshape(-1) for n in names])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    result["ranks_agree"] = all(torch.equal(g, gathered[0]) for g in gathered)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # no rank leaves (and no node's agent, which holds the rendezvous store, shuts down) while another still uses
    # the group: a rank whose peers had gone aborted in gloo at exit ("terminate called without an active exception")
    world = dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    # nor before every rank has torn its groups down: under load, a rank still in destroy_process_group when its
    # peer exited aborted the same way (every rank runs on this machine, so a file in OUT_FOLDER marks each one done)
    (out / f"done{rank}").touch()
    deadline = time.monotonic() + 300
    while not all((out / f"done{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: the other ranks did not finish within 300 s")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
