"""Several drives at once: N = 1, 2 and 4 loop-device drives, each throttled by the blkio cgroup to the same
bandwidth B (bytes/s, reads and writes), measured in one run, interleaved (every round visits every N in turn):

- the aggregate write and read bandwidth of ``deepoffload bench --folder ...`` (every drive at once), against N x B;
- an offloaded Adam step (``OffloadedOptimizer``, ``SwapConfig(folder=[...])``) over ``--state-mb`` of state, against
  its raw bound (the state's bytes read plus written at the aggregate bandwidth measured in the same round), its
  result checked bit-identical to in-memory Adam;
- streamed generation (``from_pretrained(path=[...])`` of a small Llama, no block kept resident), seconds per token;
- side by side, for every N >= 2, an mdadm RAID0 of N more loop devices throttled to the same B (one ext4 on the
  array, one folder): the bench's bandwidth and the same Adam step on it. Where the array cannot be made (no mdadm;
  a kernel without the md driver, as in a Firecracker VM: no /proc/mdstat) the reason is printed and written in the
  JSON's ``notes``.

B (default 20 MB/s) is chosen low enough that the drives, not the CPU, bound the step: 128 MiB of Adam state is
read and written (256 MiB) in 12.8 s on one drive and 3.2 s on four, against about a second of Adam arithmetic.

    python benchmarks/drives.py [--drives 1,2,4] [--bps 20e6] [--state-mb 128] [--rounds 3] [--quick] [--json FILE]

Needs root (loop devices, mounts and the blkio cgroup; ``tests/support/drives.py``): elsewhere it says why in one
line and exits with status 2. Goals (issue 41): aggregate >= 0.9 x N x B for N = 2, 4; the step on 2 drives >= 1.7x
as fast as on 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests/support/drives.py: the drives fixture)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_main, write_json  # noqa: E402

from tests.support.drives import BLKIO, Drives, unavailable  # noqa: E402

NUMEL = 1 << 18  # fp32 elements per parameter (1 MiB; 2 MiB of Adam state)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drives", default="1,2,4", help="the drive counts N (default 1,2,4)")
    parser.add_argument("--bps", type=float, default=20e6, help="each drive's throttle B, bytes/s (default 20e6)")
    parser.add_argument("--size-mb", type=int, default=24, help="bytes per drive per bandwidth transfer, MiB")
    parser.add_argument("--state-mb", type=int, default=128, help="Adam state of the offloaded step, MiB")
    parser.add_argument("--tokens", type=int, default=4, help="tokens generated per generate round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: N = 1, 2, tiny sizes, one round")
    parser.add_argument("--json", metavar="FILE", help="write the results for benchmarks/plot.py")
    args = parser.parse_args(argv)
    if args.quick:
        args.drives, args.bps, args.size_mb, args.state_mb, args.tokens, args.rounds = "1,2", 200e6, 4, 8, 2, 1
    return args


def raid0_unavailable() -> str | None:
    """Why an mdadm RAID0 cannot be made here, or None when it may be."""
    if shutil.which("mdadm") is None:
        return "mdadm is not installed (apt-get install -y mdadm)"
    if not os.path.exists("/proc/mdstat"):
        return f"this kernel ({os.uname().release}) has no md driver (no /proc/mdstat; modprobe md_mod finds no module)"
    return None


class Raid0:
    """An mdadm RAID0 of ``count`` loop devices (each throttled to ``bps`` inside ``throttled()``), one ext4 on it.

    Args:
        count: How many loop devices.
        size: Bytes of each device.
        bps: Each loop device's throttle, bytes/s (reads and writes).
    """

    def __init__(self, count: int, size: int, bps: int):
        self.count, self.size, self.bps = count, size, bps
        self.folders: list[str] = []
        self._root = tempfile.mkdtemp(prefix="deepoffload-raid0-")
        self._loops: list[str] = []
        self._array: str | None = None
        self._mount: str | None = None
        self.cgroup: Path | None = None

    def __enter__(self) -> "Raid0":
        def run(*argv: str) -> str:
            return subprocess.run(list(argv), check=True, capture_output=True, text=True).stdout.strip()

        try:
            for i in range(self.count):
                image = os.path.join(self._root, f"member{i}.img")
                with open(image, "wb") as f:
                    f.truncate(self.size)
                self._loops.append(run("losetup", "-f", "--show", image))
            self._array = f"/dev/md/deepoffload-bench-{os.getpid()}-{self.count}"
            run("mdadm", "--create", self._array, "--run", "--level=0", f"--raid-devices={self.count}", *self._loops)
            run("mkfs.ext4", "-q", "-F", "-m", "0", self._array)
            self._mount = os.path.join(self._root, "mnt")
            os.mkdir(self._mount)
            run("mount", self._array, self._mount)
            self.folders = [self._mount]
            self.cgroup = BLKIO / f"deepoffload-raid0-{os.getpid()}-{self.count}"
            self.cgroup.mkdir()
            for loop in self._loops:
                st = os.stat(loop)
                for key in ("read", "write"):
                    limit = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {self.bps}"
                    (self.cgroup / f"blkio.throttle.{key}_bps_device").write_text(limit)
        except BaseException:
            self.__exit__()
            raise
        return self

    throttled = Drives.throttled  # the same move into the cgroup and back

    def __exit__(self, *exc) -> None:
        if self._mount is not None:
            subprocess.run(["umount", "-l", self._mount], check=False, capture_output=True)
            self._mount = None
        if self._array is not None:
            subprocess.run(["mdadm", "--stop", self._array], check=False, capture_output=True)
            self._array = None
        for loop in self._loops:
            subprocess.run(["losetup", "-d", loop], check=False, capture_output=True)
        self._loops.clear()
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()
            self.cgroup = None
        shutil.rmtree(self._root, ignore_errors=True)


def raid0_arrays(stack: contextlib.ExitStack, counts: list[int], size: int, bps: int) -> tuple[dict, str | None]:
    """A RAID0 per count >= 2, entered on ``stack``; or none and the reason."""
    reason = raid0_unavailable()
    arrays: dict[int, Raid0] = {}
    if reason is None:
        try:
            arrays = {n: stack.enter_context(Raid0(n, size, bps)) for n in counts if n >= 2}
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            reason = f"mdadm could not make the array here: {detail.strip()}"
            arrays = {}
    return arrays, reason


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
        arrays, raid_reason = raid0_arrays(stack, counts, drive_bytes, int(args.bps))
        if raid_reason is not None:
            print(f"drives: no mdadm RAID0 side by side: {raid_reason}")
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
                if n in arrays:  # the RAID0 of as many throttled devices, in the same round
                    with arrays[n].throttled():
                        raid_write, raid_read = bandwidth(arrays[n].folders, size * n)
                        raid_step, raid_same = adam_step(arrays[n].folders, state)
                    identical &= raid_same
                    for key, value in (("raid_write", raid_write), ("raid_read", raid_read), ("raid_step", raid_step)):
                        rows[n].setdefault(key, []).append(value)
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
        if "raid_step" in m:
            print(
                f"   RAID0 of {n}: write {m['raid_write']:.3f} GB/s ({m['raid_write'] / ideal(n):.2f}), read "
                f"{m['raid_read']:.3f} GB/s ({m['raid_read'] / ideal(n):.2f}), Adam step {m['raid_step']:.3f} s; "
                f"ours / RAID0 speed {m['raid_step'] / m['step']:.2f}"
            )
            results += [
                {"label": f"write, RAID0 of {n} (of N x B)", "value": m["raid_write"] / ideal(n), "bound": 0.9},
                {"label": f"read, RAID0 of {n} (of N x B)", "value": m["raid_read"] / ideal(n), "bound": 0.9},
                {
                    "label": f"Adam step, {n} drives / RAID0 of {n} (speed)",
                    "value": m["raid_step"] / m["step"],
                    "bound": 1.0,
                },
            ]
    print(f"offloaded Adam bit-identical to in-memory Adam: {identical}")
    if args.json:
        write_json(args.json, "drives", f"Several drives, each throttled to {args.bps / 1e6:g} MB/s", results)
        if raid_reason is not None:  # why the RAID0 rows are missing, kept with the figures
            with open(args.json) as f:
                record = json.load(f)
            record["notes"] = [f"no mdadm RAID0 side by side: {raid_reason}"]
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
                f.write("\n")
    return 0 if identical else 1


if __name__ == "__main__":
    run_main("drives", main)
