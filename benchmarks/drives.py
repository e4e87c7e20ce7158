"""Several drives at once: N = 1, 2 and 4 loop-device drives, each throttled by the blkio cgroup to the same
bandwidth B (bytes/s, reads and writes), measured in one run, interleaved (every round visits every N in turn):

- the aggregate write and read bandwidth of ``deepoffload bench --folder ...`` (every drive at once), against N x B;
- an offloaded Adam step (``OffloadedOptimizer``, ``SwapConfig(folder=[...])``) over ``--state-mb`` of state, against
  its raw bound (the state's bytes read plus written at the aggregate bandwidth measured in the same round), its
  result checked bit-identical to in-memory Adam;
- streamed generation (``from_pretrained(path=[...])`` of a small Llama, no block kept resident), seconds per token.

    python benchmarks/drives.py [--drives 1,2,4] [--bps 50e6] [--state-mb 128] [--rounds 3] [--quick] [--json FILE]

Needs root (loop devices, mounts and the blkio cgroup; ``tests/support/drives.py``): elsewhere it says why in one
line and exits with status 2. Goals (issue 41): aggregate >= 0.9 x N x B for N = 2, 4; the step on 2 drives >= 1.7x
as fast as on 1.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests/support/drives.py: the drives fixture)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_main, write_json  # noqa: E402

from tests.support.drives import Drives, unavailable  # noqa: E402

NUMEL = 1 << 18  # fp32 elements per parameter (1 MiB; 2 MiB of Adam state)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drives", default="1,2,4", help="the drive counts N (default 1,2,4)")
    parser.add_argument("--bps", type=float, default=50e6, help="each drive's throttle B, bytes/s (default 50e6)")
    parser.add_argument("--size-mb", type=int, default=64, help="bytes per drive per bandwidth transfer, MiB")
    parser.add_argument("--state-mb", type=int, default=128, help="Adam state of the offloaded step, MiB")
    parser.add_argument("--tokens", type=int, default=4, help="tokens generated per generate round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: N = 1, 2, tiny sizes, one round")
    parser.add_argument("--json", metavar="FILE", help="write the results for benchmarks/plot.py")
    args = parser.parse_args(argv)
    if args.quick:
        args.drives, args.bps, args.size_mb, args.state_mb, args.tokens, args.rounds = "1,2", 200e6, 4, 8, 2, 1
    return args


def bandwidth(folders: list[str], nbytes: int) -> tuple[float, float]:
    """(write, read) aggregate GB/s of every drive at once (``deepoffload bench --folder ...``'s together row)."""
    from deepoffload.bench.drives import measure_drives
    from deepoffload.config import AioConfig

    report = measure_drives(folders, nbytes, AioConfig(), loops=1).to_dict()["results"]
    return report["write"]["together"]["median_gbps"], report["read"]["together"]["median_gbps"]


def adam_step(folders: list[str], state_bytes: int) -> tuple[float, bool]:
    """Seconds of the second offloaded Adam step (the first creates the state), and whether the parameters after
    both steps equal in-memory Adam's bit for bit."""
    import torch

    from deepoffload import OffloadedOptimizer, SwapConfig

    count = max(1, state_bytes // (8 * NUMEL))
    params = [torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))) for i in range(count)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.Adam(reference, lr=1e-3)
    config = SwapConfig(folder=folders if len(folders) > 1 else folders[0], chunk_bytes=4 << 20, pin=False)
    with OffloadedOptimizer(torch.optim.Adam, params, config, lr=1e-3) as opt:
        seconds = 0.0
        for step in range(2):
            for i, (p, r) in enumerate(zip(params, reference)):
                g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + i))
                p.grad, r.grad = g, g.clone()
            start = time.perf_counter()
            opt.step()
            seconds = time.perf_counter() - start
            plain.step()
    return seconds, all(torch.equal(p, r) for p, r in zip(params, reference))


def tiny_llama(folder: Path, quick: bool) -> Path:
    import torch
    import transformers

    width = 64 if quick else 512
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=4, num_attention_heads=4
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "llama")
    return folder / "llama"


def generate(folders: list[str], checkpoint: Path, tokens: int) -> float:
    """Seconds per generated token with every block streamed from the drives."""
    import torch

    import deepoffload

    model, off = deepoffload.from_pretrained(checkpoint, path=folders if len(folders) > 1 else folders[0])
    with off, torch.no_grad():
        ids = torch.ones(1, 8, dtype=torch.long)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return (time.perf_counter() - start) / tokens


def main() -> int:
    args = arguments()
    reason = unavailable("loop", throttle=True)
    if reason is not None:
        print(f"drives: cannot make throttled drives here: {reason}", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")
    counts = [int(n) for n in args.drives.split(",")]
    size, state = args.size_mb << 20, args.state_mb << 20
    drive_bytes = max(size, state // min(counts)) * 2 + (64 << 20)
    rows: dict[int, dict[str, list[float]]] = {n: {} for n in counts}
    identical = True
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="drives-bench-")))
        checkpoint = tiny_llama(scratch, args.quick)
        sets = {n: stack.enter_context(Drives(n, size=drive_bytes, bps=int(args.bps))) for n in counts}
        for _ in range(args.rounds):
            for n in counts:  # interleaved: each round visits every N
                drives = sets[n]
                with drives.throttled():
                    write, read = bandwidth(drives.folders, size)
                    step, same = adam_step(drives.folders, state)
                    per_token = generate(drives.folders, checkpoint, args.tokens)
                identical &= same
                bound = 2 * state / (min(write, read) * 1e9)  # the state read and written at the aggregate speed
                for key, value in (("write", write), ("read", read), ("step", step), ("bound", bound)):
                    rows[n].setdefault(key, []).append(value)
                rows[n].setdefault("token", []).append(per_token)
    ideal = lambda n: n * args.bps / 1e9  # noqa: E731
    print(f"N drives each throttled to B = {args.bps / 1e6:.0f} MB/s; medians of {args.rounds} interleaved rounds")
    print(f"{'N':>2} {'write GB/s':>11} {'/ N x B':>8} {'read GB/s':>10} {'/ N x B':>8} {'Adam step s':>12}")
    print(f"{'':>2} {'':>11} {'':>8} {'':>10} {'':>8} {'':>12} {'/ raw bound':>12} {'speed-up':>9} {'s/token':>8}")
    first = statistics.median(rows[counts[0]]["step"])
    results = []
    for n in counts:
        m = {k: statistics.median(v) for k, v in rows[n].items()}
        print(
            f"{n:>2} {m['write']:11.3f} {m['write'] / ideal(n):8.2f} {m['read']:10.3f} {m['read'] / ideal(n):8.2f} "
            f"{m['step']:12.3f} {m['step'] / m['bound']:12.2f} {first / m['step']:9.2f} {m['token']:8.3f}"
        )
        results += [
            {"label": f"write, {n} drives (of N x B)", "value": m["write"] / ideal(n), "bound": 0.9},
            {"label": f"read, {n} drives (of N x B)", "value": m["read"] / ideal(n), "bound": 0.9},
            {
                "label": f"Adam step speed-up, {n} drives",
                "value": first / m["step"],
                **({"bound": 1.7} if n == 2 else {}),
            },
        ]
    print(f"offloaded Adam bit-identical to in-memory Adam: {identical}")
    if args.json:
        write_json(args.json, "drives", "Several throttled drives at once", results)
    return 0 if identical else 1


if __name__ == "__main__":
    run_main("drives", main)
