"""DeepSpeed ZeRO-3 with optimizer state and parameters on NVMe, on DeepSpeed's own async_io op (A) and on
deepoffload's (B, through ``deepoffload.integrations.deepspeed.enable()``), interleaved A B A B in fresh processes.

Prints: whether losses and final parameters are bit-identical between A and B, the median step-time ratio B/A
(steps after the first), and the first-use load time of each op in its first run (a JIT build when its cache is
empty: DeepSpeed's takes minutes; clear ``~/.cache/torch_extensions`` and ``DEEPOFFLOAD_CACHE_DIR`` to measure builds).

    python benchmarks/deepspeed_zero3_ab.py --path /nvme/dir --rounds 2 --steps 6

Needs DeepSpeed and libaio-dev (for DeepSpeed's op). Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def child(args: argparse.Namespace) -> None:
    import torch

    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo only: build nothing but the IO op
    if args.ours:
        from deepoffload.integrations import deepspeed as integration

        integration.enable()
    t0 = time.perf_counter()
    deepspeed.ops.op_builder.AsyncIOBuilder().load()
    load_s = time.perf_counter() - t0
    aio = {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1, "single_submit": False,
           "overlap_events": True}
    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_force_ds_cpu_optimizer": False, "aio": aio,
           "steps_per_print": 10**9,
           "zero_optimization": {
               "stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
               "stage3_max_live_parameters": 3_000_000, "stage3_param_persistence_threshold": 0,
               "offload_optimizer": {"device": "nvme", "nvme_path": args.path, "pin_memory": True,
                                     "buffer_count": 4},
               "offload_param": {"device": "nvme", "nvme_path": args.path, "pin_memory": True, "buffer_count": 8,
                                 "buffer_size": 1 << 22, "max_in_cpu": 0}}}
    deepspeed.init_distributed(dist_backend="gloo")
    width = args.width
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(args.layers)],
                                    torch.nn.Linear(width, 1))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4),
                                      config=cfg)
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(args.steps):
        x, y = torch.randn(8, width, generator=gen), torch.randn(8, 1, generator=gen)
        t = time.perf_counter()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        digest = torch.cat([p.detach().reshape(-1) for p in params]).view(torch.int32).sum().item()
    handle = type(engine.optimizer.optimizer_swapper.aio_handle).__module__
    print(json.dumps({"losses": losses, "times": times, "params_digest": digest, "load_s": load_s,
                      "handle": handle}))


def run(args: argparse.Namespace, ours: bool) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    with tempfile.TemporaryDirectory(dir=args.path) as folder:
        cmd = [sys.executable, __file__, "--child", "--path", folder, "--steps", str(args.steps), "--width",
               str(args.width), "--layers", str(args.layers)] + (["--ours"] if ours else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        sys.exit(f"{'ours' if ours else 'DeepSpeed'} run failed:\n{proc.stderr[-4000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default=".", help="folder on the storage to test (swap files go there)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ours", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    results = {False: [], True: []}
    for _ in range(args.rounds):
        for ours in (False, True):  # A B A B
            results[ours].append(run(args, ours))
    theirs, ours = results[False], results[True]
    identical = all(a["losses"] == b["losses"] and a["params_digest"] == b["params_digest"]
                    for a, b in zip(theirs, ours))
    ratios = [statistics.median(b["times"][1:]) / statistics.median(a["times"][1:]) for a, b in zip(theirs, ours)]
    print(f"handles: DeepSpeed run {theirs[0]['handle']}, ours {ours[0]['handle']}")
    print(f"losses and final parameters bit-identical: {'yes' if identical else 'NO'} "
          f"({args.rounds} rounds x {args.steps} steps)")
    print(f"step time ours / DeepSpeed's (median of rounds, steps after the first): {statistics.median(ratios):.3f} "
          f"(per round: {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"first use, load time of the op: DeepSpeed {theirs[0]['load_s']:.1f} s, ours {ours[0]['load_s']:.1f} s")


if __name__ == "__main__":
    main()
