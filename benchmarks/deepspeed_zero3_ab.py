"""DeepSpeed ZeRO-3 with optimizer state and parameters on NVMe: DeepSpeed's own async_io op (A) against
deepoffload's (B, through ``deepoffload.integrations.deepspeed.enable()``), interleaved A B A B in fresh processes.

Prints whether losses and final parameters are bit-identical between A and B, the median step-time ratio B/A (steps
after the first), the first-use load time of each op in its first run, and which share of the bytes our handles
moved sat in buffers aligned to 1 KiB but not to a page (DeepSpeed's parameter swap layout: ``buffer_size`` elements
rounded to 1 KiB x threads; the default 1 MiB + 256 elements makes most of its buffers so, as DeepSpeed's default
``buffer_size`` of 1e8 does).

``--compare page-alignment`` runs B against B with the direct-IO memory alignment that ``statx`` reports raised to
4096 bytes (a system-call shim loaded with LD_PRELOAD; compiled with ``cc``), so that 1 KiB-aligned buffers are
bounced: the parameter-offload step-time ratio of taking them directly.

    python benchmarks/deepspeed_zero3_ab.py --path /nvme/dir [--rounds 2] [--steps 5] [--compare page-alignment]

DeepSpeed's op is built on first use (minutes; needs libaio-dev); ``--fresh-cache`` builds ours into an empty cache
in its first run so its build time shows. Needs DeepSpeed. Not run in CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

# Raises stx_dio_mem_align (struct statx offset 0x98) to 4096 in what syscall(SYS_statx, ...) returns.
PAGE_ALIGNMENT_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <sys/syscall.h>
long syscall(long number, ...) {
    static long (*real)(long, ...);
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (int i = 0; i < 6; ++i) a[i] = va_arg(ap, long);
    va_end(ap);
    long rc = real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
    if (number == SYS_statx && rc == 0 && (a[3] & 0x2000)) {
        uint32_t* memory_alignment = (uint32_t*)((char*)a[4] + 0x98);
        if (*memory_alignment && *memory_alignment < 4096) *memory_alignment = 4096;
    }
    return rc;
}
"""


def child(args: argparse.Namespace) -> None:
    import deepspeed
    import torch

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo only: build nothing but the IO op
    layout = {"page": 0, "kib": 0, "other": 0}
    if args.ours:
        from deepoffload.integrations import deepspeed as integration
        from deepoffload.io import compat

        integration.enable()
        transfer = compat.aio_handle._transfer

        def counting(self, write, buffer, *rest, **kwargs):
            address = buffer.data_ptr()
            kind = "page" if address % 4096 == 0 else "kib" if address % 1024 == 0 else "other"
            layout[kind] += buffer.numel() * buffer.element_size()
            return transfer(self, write, buffer, *rest, **kwargs)

        compat.aio_handle._transfer = counting
    t0 = time.perf_counter()
    op = deepspeed.ops.op_builder.AsyncIOBuilder().load()
    load_s = time.perf_counter() - t0
    aio = {
        "block_size": 1 << 20,
        "queue_depth": 32,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
    }
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_force_ds_cpu_optimizer": False,
        "aio": aio,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 3,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_live_parameters": 3_000_000,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": args.path, "pin_memory": True, "buffer_count": 4},
            "offload_param": {
                "device": "nvme",
                "nvme_path": args.path,
                "pin_memory": True,
                "buffer_count": 8,
                "buffer_size": args.buffer_numel,
                "max_in_cpu": 0,
            },
        },
    }
    deepspeed.init_distributed(dist_backend="gloo")
    width = args.width
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Linear(width, width) for _ in range(args.layers)], torch.nn.Linear(width, 1)
        )
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4), config=cfg)
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
        flat = torch.cat([p.detach().reshape(-1) for p in params])
    print(
        json.dumps(
            {
                "losses": losses,
                "times": times,
                "params_sha256": hashlib.sha256(flat.numpy()).hexdigest(),
                "load_s": load_s,
                "op": getattr(op, "__file__", type(op).__name__),
                "handle": type(engine.optimizer.optimizer_swapper.aio_handle).__module__,
                "layout": layout,
            }
        )
    )


def run(args: argparse.Namespace, variant: str, env_extra: dict[str, str]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        **env_extra,
    }
    with tempfile.TemporaryDirectory(dir=args.path) as folder:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--path",
            folder,
            "--steps",
            str(args.steps),
            "--width",
            str(args.width),
            "--layers",
            str(args.layers),
            "--buffer-numel",
            str(args.buffer_numel),
        ]
        proc = subprocess.run(
            cmd + (["--ours"] if variant != "deepspeed" else []), capture_output=True, text=True, env=env, timeout=3600
        )
    if proc.returncode:
        sys.exit(f"{variant} run failed:\n{proc.stderr[-4000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default=".", help="folder on the storage to test (swap files go there)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--buffer-numel", type=int, default=(1 << 20) + 256, help="offload_param buffer_size")
    p.add_argument("--compare", choices=("deepspeed", "page-alignment"), default="deepspeed")
    p.add_argument("--fresh-cache", action="store_true", help="build our op into an empty cache in its first run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ours", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as work:
        envs = {"ours": {}, "deepspeed": {}}
        names = ("deepspeed", "ours")
        if args.compare == "page-alignment":
            shim = os.path.join(work, "page_alignment.so")
            source = os.path.join(work, "page_alignment.c")
            with open(source, "w") as f:
                f.write(PAGE_ALIGNMENT_SHIM)
            subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", shim, source, "-ldl"], check=True)
            envs = {"ours": {}, "ours-page": {"LD_PRELOAD": shim}}
            names = ("ours-page", "ours")
        if args.fresh_cache:
            envs["ours"]["DEEPOFFLOAD_CACHE_DIR"] = os.path.join(work, "cache")
        a_name, b_name = names
        results: dict[str, list[dict]] = {a_name: [], b_name: []}
        for _ in range(args.rounds):
            for name in names:  # A B A B
                results[name].append(run(args, name, envs[name]))
    a, b = results[a_name], results[b_name]
    identical = all(x["losses"] == y["losses"] and x["params_sha256"] == y["params_sha256"] for x, y in zip(a, b))
    ratios = [statistics.median(y["times"][1:]) / statistics.median(x["times"][1:]) for x, y in zip(a, b)]
    layout = b[0]["layout"]
    moved = sum(layout.values()) or 1
    print(
        f"ZeRO-3, optimizer state and parameters on NVMe: {args.layers + 1} layers of width {args.width}, "
        f"{args.steps} steps x {args.rounds} rounds, interleaved {a_name} / {b_name}"
    )
    print(f"op/handle: {a_name} {a[0]['op']} ({a[0]['handle']}); {b_name} {b[0]['op']} ({b[0]['handle']})")
    print(f"losses and final parameters bit-identical: {'yes' if identical else 'NO'}")
    print(
        f"step time {b_name} / {a_name} (median of rounds, steps after the first): {statistics.median(ratios):.3f} "
        f"(per round: {', '.join(f'{r:.3f}' for r in ratios)}; median step {a_name} "
        f"{statistics.median(t for x in a for t in x['times'][1:]):.3f} s, {b_name} "
        f"{statistics.median(t for y in b for t in y['times'][1:]):.3f} s)"
    )
    print(
        f"first use, load of the op in the first run: {a_name} {a[0]['load_s']:.1f} s, {b_name} {b[0]['load_s']:.1f} s"
    )
    print(
        f"bytes our handles moved, by buffer address: page-aligned {layout['page'] / moved:.0%}, 1 KiB-aligned "
        f"only {layout['kib'] / moved:.0%}, other {layout['other'] / moved:.0%} ({moved / 1e6:.0f} MB)"
    )


if __name__ == "__main__":
    main()
