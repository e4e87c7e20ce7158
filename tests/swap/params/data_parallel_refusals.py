"""Child process of tests/swap/params/test_data_parallel.py: one gloo rank (world size 1, 127.0.0.1) trying the
wrappings that cannot hold a streamed model; prints one JSON line {case: the error's type and message, or
"no error"}."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from deepoffload import OffloadedOptimizer, SwapConfig, TrainOptions, offload_parameters


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))


def attempt(results: dict, case: str, action) -> None:
    try:
        action()
        results[case] = "no error"
    except Exception as e:  # the test checks the type and the message
        results[case] = f"{type(e).__name__}: {e}"


def main() -> None:
    folder = sys.argv[1]
    dist.init_process_group("gloo", rank=0, world_size=1)
    adam = lambda ps: torch.optim.Adam(ps)  # noqa: E731
    results: dict = {}
    inner = net()
    wrapper = DistributedDataParallel(inner)
    attempt(results, "ddp_then_offload", lambda: offload_parameters(inner, folder, train=TrainOptions(optimizer=adam)))
    attempt(
        results,
        "ddp_wrapper_offloaded",
        lambda: offload_parameters(wrapper, folder, train=TrainOptions(optimizer=adam)),
    )
    streamed = net()
    off = offload_parameters(streamed, folder, train=TrainOptions(optimizer=adam))
    attempt(results, "offload_then_ddp", lambda: DistributedDataParallel(streamed))
    attempt(results, "offload_then_fully_shard", lambda: fully_shard(streamed))
    off.close()
    sharded = net()
    fully_shard(sharded)
    attempt(
        results,
        "fully_shard_then_offload",
        lambda: offload_parameters(sharded, folder, train=TrainOptions(optimizer=adam)),
    )
    attempt(
        results,
        "bad_data_parallel",
        lambda: offload_parameters(net(), folder, train=TrainOptions(optimizer=adam, data_parallel="yes")),
    )
    with torch.device("meta"):
        meta = net()
    attempt(
        results,
        "meta_without_checkpoint",
        lambda: offload_parameters(meta, folder, train=TrainOptions(optimizer=adam, data_parallel=True)),
    )
    in_ddp = net()
    ddp = DistributedDataParallel(in_ddp)  # noqa: F841  (alive, as a training loop keeps it)
    optimizer = OffloadedOptimizer(torch.optim.Adam, list(in_ddp.parameters()), SwapConfig(folder=folder))
    attempt(results, "step_in_backward_under_ddp", optimizer.step_in_backward)
    optimizer.close()
    # step_in_backward() first, DDP built afterwards: found at step(), after DDP replaced the gradients
    later = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optimizer = OffloadedOptimizer(torch.optim.Adam, list(later.parameters()), SwapConfig(folder=folder))
    optimizer.step_in_backward()
    wrapped = DistributedDataParallel(later)
    wrapped(torch.ones(2, 4)).sum().backward()
    attempt(results, "ddp_after_step_in_backward", optimizer.step)
    optimizer.close()
    results["left"] = sorted(os.listdir(folder))
    # a data-parallel setup failing part way (here: writing the blocks out) leaves no hook on the model
    from deepoffload.swap.params.storage.store import BlockStore

    def disk_full(self):
        raise OSError(28, "No space left on device (simulated)")

    original, BlockStore.offload_all = BlockStore.offload_all, disk_full
    failed = net()
    attempt(
        results,
        "failed_setup",
        lambda: offload_parameters(failed, folder, train=TrainOptions(optimizer=adam, data_parallel=True)),
    )
    BlockStore.offload_all = original
    results["hooks_left_after_failed_setup"] = [
        len(failed._forward_pre_hooks),
        sum(len(p._post_accumulate_grad_hooks or {}) for p in failed.parameters()),
    ]
    print(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
