"""Two ranks on gloo (CPU): FSDP2 (fully_shard, DTensor parameters) and DistributedDataParallel with offloaded
optimizer state give the same losses and parameters, bit for bit, as the same runs with the plain optimizer. Each
rank swaps only its own (local-shard) state, into its own folder.

The test runs this file as a script in a fresh process that spawns the two ranks (``torch.multiprocessing``); a
multi-node job is the same code under ``torchrun --nnodes N --nproc-per-node M``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STEPS = 8
WORLD = 2


def build(wrap: str):
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    if wrap == "fsdp":
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        return fully_shard(model)
    return DistributedDataParallel(model)


def train(model, optimizer, rank: int) -> list[float]:
    import torch

    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def worker(rank: int, wrap: str, folder: str, store: str, results: str) -> None:
    import torch
    import torch.distributed as dist

    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        plain_model = build(wrap)
        plain_losses = train(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=0.01, amsgrad=True), rank)
        model = build(wrap)
        optimizer = OffloadedOptimizer(
            torch.optim.AdamW, model.parameters(), SwapConfig(folder=folder, chunk_bytes=4096), lr=0.01, amsgrad=True
        )
        losses = train(model, optimizer, rank)
        weight = next(model.parameters())
        record = optimizer.swapper.records(optimizer.pipeline.name(weight))["exp_avg"]
        local_shape = tuple(weight.to_local().shape) if hasattr(weight, "to_local") else tuple(weight.shape)
        same_params = all(torch.equal(full(a), full(b)) for a, b in zip(plain_model.parameters(), model.parameters()))
        result = {
            "losses_match": losses == plain_losses,
            "params_match": same_params,
            "folder": optimizer.swapper.folder,
            "stored_shape": list(record.shape),
            "local_shape": list(local_shape),
            "dtensor": record.dtensor is not None,
            "stored_bytes": optimizer.stored_bytes(),
            "losses": losses,
        }
        optimizer.close()
        with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def launch(wrap: str, folder: str, results: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(wrap, folder, os.path.join(results, "store"), results), nprocs=WORLD, join=True)


def run_two_ranks(wrap: str, scratch, tmp_path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, __file__, wrap, str(scratch), str(tmp_path)], check=True, timeout=180, env=env)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_fsdp2_offloaded_matches_plain(scratch, tmp_path):
    ranks = run_two_ranks("fsdp", scratch, tmp_path)
    for rank, result in enumerate(ranks):
        assert result["losses_match"] and result["params_match"], rank
        assert os.path.basename(result["folder"]).startswith(f"deepoffload-rank{rank}-")
        assert result["dtensor"] and result["stored_shape"] == result["local_shape"]
        assert result["local_shape"] == [16, 16]  # the (32, 16) weight's shard: each rank stores half
    assert ranks[0]["losses"] != ranks[1]["losses"]  # the ranks really saw different data
    assert not any(name.name.startswith("deepoffload-") for name in scratch.iterdir())


@pytest.mark.slow
def test_ddp_offloaded_matches_plain(scratch, tmp_path):
    ranks = run_two_ranks("ddp", scratch, tmp_path)
    for rank, result in enumerate(ranks):
        assert result["losses_match"] and result["params_match"], rank
        assert os.path.basename(result["folder"]).startswith(f"deepoffload-rank{rank}-")
        assert not result["dtensor"] and result["stored_shape"] == result["local_shape"] == [32, 16]
    assert ranks[0]["stored_bytes"] == ranks[1]["stored_bytes"]


if __name__ == "__main__":
    launch(*sys.argv[1:])
