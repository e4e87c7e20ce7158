"""The memory harness: each library entry point (``workloads.py``) runs in a child confined by a memory cgroup set
to its stated bound plus 10%, and its peak (the group's ``memory.max_usage_in_bytes``: anonymous memory and the page
cache it charged) must stay within the bound.

The stated bound of an entry point = the process after its imports (measured: a child that only imports, under the
same kind of group) + what the library holds (``MemoryPlan.peak_bytes`` for ``offload_parameters``; its staging
pools for the others) + what the user's own code holds (the model in memory, a returned state dict, the forward's
activations: ``FORWARD_BYTES``). ``python tests/memory/bounds.py [SHAPE...]`` prints every figure (the table in
dev-notes/m26.md is its output)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "support"), str(HERE)]  # tests/support (memlimit) and this folder (workloads)

import memlimit  # noqa: E402
import workloads  # noqa: E402

from deepoffload.swap.params.budget import FORWARD_BYTES as FIT_FORWARD_BYTES  # noqa: E402
from deepoffload.swap.params.budget import MIN_STATE_CHUNKS, MemoryPlan  # noqa: E402

MiB = 1 << 20
FORWARD_BYTES = 16 << 20  # the workloads' forward: a batch of 4, activations far below a block
CHECKPOINT_STAGING = (8 + 4) * 16 * MiB  # deepoffload.save/load's staging pool (formats.torch_zip.streams), kept idle
SAVE_STAGING = 2 * 16 * MiB  # save_sharded's two staging buffers
SAVE_SMALL_FILES = 1 * MiB  # the index and the shards' headers, written through the page cache the group is charged
OPTIMIZER_POOL = 4  # SwapConfig's default buffer_count
OPTIMIZER_TEMPORARIES = 3  # Adam's step on the largest parameter: gradient, and two temporaries of its size
ENTRIES = (
    "load_safetensors",
    "load_sharded",
    "load_torch",
    "train_fused",
    "train_grads",
    "train_budget",
    "train_max_memory",
    "generate",
    "save",
    "state_dict",
    "checkpoint_save",
    "checkpoint_load",
    "optimizer_step",
    "train_data_parallel",
    "train_data_parallel_grads",
    "train_activations",
    "generate_storage_cache",
    "lora_served",
    "moe_generate",
)
# entries measured at the "large" shape only (their own model)
ONE_SHAPE = ("generate", "generate_storage_cache", "lora_served", "moe_generate")
# entries whose proof takes minutes (a 2.7 GB base; a 4096-token prompt three times): their own tests
# (test_bounds.py, tests/kv/test_storage_cache_memory.py) run them with DEEPOFFLOAD_TEST_LARGE_MEMORY=1
LARGE = ("lora_served", "generate_storage_cache")


@dataclass
class Measured:
    entry: str
    shape: str
    base: int  # the process after imports
    library: int  # what the library holds (stated)
    user: int  # what the user's code holds (stated)
    peak: int | None  # measured
    result: object

    @property
    def bound(self) -> int:
        return self.base + self.library + self.user


def child(
    entry: str, shape: str, folder: Path, limit: int | None, max_memory: int | None = None
) -> memlimit.LimitedRun:
    """Run one workload; confined to ``limit`` bytes, or unconfined (None); ``max_memory``: the workload's
    offload_parameters(max_memory=) (train_max_memory)."""
    for name in ("swap", "saved", "saved.pt"):
        path = folder / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    argv = [sys.executable, str(HERE / "workloads.py"), entry, shape, str(folder)]
    env = _env()
    if max_memory is not None:
        env["MAX_MEMORY"] = str(max_memory)
    if limit is None:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        return memlimit.LimitedRun(proc.returncode, proc.stdout, proc.stderr, None, 0)
    _drop_cached(folder)
    return memlimit.run_limited(argv, limit, env=env, timeout=600)


def _drop_cached(folder: Path) -> None:
    """Evict the checkpoints from the page cache, so that a child reading them is charged for what it keeps cached
    (the worst case) whatever ran before."""
    for name in workloads.CHECKPOINTS.values():
        for path in [folder / name] if (folder / name).is_file() else sorted((folder / name).glob("*")):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def needs(entry: str) -> str | None:
    """The checkpoint kind (``workloads.CHECKPOINTS``) ``entry`` reads, or None."""
    return workloads.NEEDS.get(entry, "safetensors")


def build_op() -> None:
    """Build the op (or find it built) unconfined, in a child with the workloads' environment: a confined child must
    not be charged for, or killed by, the compiler it would otherwise start on first use."""
    proc = subprocess.run(
        [sys.executable, "-c", "from op_builder import AsyncIOBuilder; AsyncIOBuilder().load()"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    if proc.returncode:
        raise RuntimeError(f"building the op failed: {proc.stderr[-2000:]}")


def prepare(shape: str, folder: Path, kinds: list[str]) -> None:
    """Write the checkpoints of ``kinds`` that ``folder`` lacks (in a child: this process never holds them)."""
    kinds = [k for k in kinds if k is not None and not (folder / workloads.CHECKPOINTS[k]).exists()]
    if kinds:
        proc = subprocess.run(
            [sys.executable, str(HERE / "workloads.py"), "prepare", shape, str(folder), *kinds],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=600,
        )
        if proc.returncode:
            raise RuntimeError(f"preparing {kinds} ({shape}) failed: {proc.stderr[-2000:]}")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's default allocator
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent)] + env.get("PYTHONPATH", "").split(os.pathsep))
    return env


def imports(entry: str) -> str:
    """The imports-only workload whose peak is ``entry``'s process after imports."""
    return workloads.IMPORTS.get(entry, "imports")


def baseline(folder: Path, kind: str = "imports") -> int:
    """The peak of a child that only imports (torch, deepoffload; ``imports_optim``: and constructs a torch
    optimizer once, which imports torch._dynamo; ``imports_hf``: and transformers), under a group."""
    run = child(kind, "large", folder, 2 << 30)
    if run.returncode or run.peak_bytes is None:
        raise RuntimeError(f"the imports-only child failed: {run}")
    return run.peak_bytes


def stated(entry: str, sizes: dict) -> tuple[int, int]:
    """(what the library holds, what the user's code holds) for ``entry``, from the model's sizes (bytes)."""
    block, rest, total, largest = sizes["block_span"], sizes["rest_bytes"], sizes["param_bytes"], sizes["largest"]
    plan = MemoryPlan(
        block_bytes=block,
        rest_bytes=rest,
        prefetch=1,
        training=entry.startswith("train_") or entry == "lora_served",
        resident_bytes=sizes.get("resident_bytes", 0),
    )
    if entry == "train_max_memory":  # about the least limit max_memory= accepts: the process, the least plan, the
        # forward; 16 MiB more: the process at the call holds a little more than after its imports (the model on meta)
        least = replace(plan, prefetch=0, state_chunks=MIN_STATE_CHUNKS, resident_bytes=0)
        return least.peak_bytes + 16 * MiB, FIT_FORWARD_BYTES
    if entry in (
        "load_safetensors",
        "load_sharded",
        "load_torch",
        "train_fused",
        "train_grads",
        "train_budget",
        "train_data_parallel",
        "train_data_parallel_grads",
        "generate",
    ):
        return plan.peak_bytes, FORWARD_BYTES
    if entry == "moe_generate":  # the plan (its resident bytes: the expert cache), the chosen experts of one layer
        # assembled for its experts module and the next layer's read ahead (each at most a block span)
        return plan.peak_bytes + 2 * block, FORWARD_BYTES
    if entry == "save":  # a block's copy, the writer's staging and its small files on top of the streaming plan
        return plan.peak_bytes + block + SAVE_STAGING + SAVE_SMALL_FILES, FORWARD_BYTES
    if entry == "state_dict":  # the returned state dict is the user's
        return plan.peak_bytes + block, total
    if entry == "checkpoint_save":  # the model in memory is the user's
        return CHECKPOINT_STAGING, total
    if entry == "checkpoint_load":  # the loaded state dict (one buffer) is the user's
        return CHECKPOINT_STAGING, total
    if entry in ("train_activations", "train_activations_plain"):
        return activation_bounds(sizes["activation_rows"])
    if entry == "generate_storage_cache":
        return kv_cache_bounds()
    if entry == "lora_served":  # the streaming plan (blocks in flight) and the adapters: values, gradients, Adam's
        # two states; nothing grows with the number of blocks but the adapters (1.5% of a block each) and the
        # inputs each block keeps for its recomputation (a (1, 8) batch: 16 KiB a block), in the forward's bytes
        return plan.peak_bytes + 4 * sizes["adapter_bytes"], FORWARD_BYTES
    if entry == "optimizer_step":  # the model and its gradients are the user's
        chunk = max(32 * MiB, 2 * largest + 2 * largest // 16)  # grows to the largest parameter's state
        # and the heap's growth a step lets pass before it trims (ChunkPipeline.trim): a staging buffer's bytes
        library = (OPTIMIZER_POOL + 1) * chunk + OPTIMIZER_TEMPORARIES * largest
        return library, 2 * total + FORWARD_BYTES
    raise ValueError(entry)


def activation_bounds(rows: int = workloads.ACTIVATIONS[2]) -> tuple[int, int]:
    """(library, user) bytes of ``train_activations`` at ``rows`` rows (offload_activations' defaults: at most
    4 x 8 MiB of saved tensors being written, or one when larger; prefetch 2): the resident part, a fixed number of
    one layer's activations whatever the number of layers: the tensors being written, the ones read ahead and the
    one in use; the user's model, its gradients, the input, two live activations of the forward and three of the
    backward (gradients and a temporary). Only the resident part grows with the sequence (``rows``)."""
    width, layers, _ = workloads.ACTIVATIONS
    act = activation_bytes(rows)
    params = layers * (width * width + width) * 4
    library = max(4 * 8 * MiB, act) + (2 + 1) * act
    return library, 2 * params + act + 2 * act + 3 * act


def kv_layer_bytes() -> int:
    """Bytes of one layer's keys and values at the end of ``generate_storage_cache`` (prompt + 4 tokens)."""
    _, heads, head_dim, tokens, _, _ = workloads.KV_CACHE
    return 2 * heads * head_dim * (tokens + 4) * 4


def kv_cache_bounds() -> tuple[int, int]:
    """(library, user) bytes of ``generate_storage_cache``. The library: ``resident_layers`` (2) layers' keys and
    values (the one computing, the one read ahead; they grow with the sequence: the documented resident part), and,
    not growing with it, every file's tail (under ``flush_bytes`` plus a page), two layers' writes in flight (a
    flush plus a chunk's append each) and a chunk's new rows. The user's: the model, and a chunk's forward (queries
    of ``chunk`` tokens against the whole sequence: scores and softmax) plus ``FORWARD_BYTES``."""
    layers, heads, head_dim, tokens, chunk, flush = workloads.KV_CACHE
    hidden = heads * head_dim
    append = 2 * chunk * hidden * 4  # a chunk's keys and values
    resident = 2 * kv_layer_bytes() * 9 // 8  # the read buffers have room for an eighth more (kv.stream.ReadBuffers)
    library = resident + 2 * layers * (flush + 4096) + 2 * (2 * flush + append) + append
    params = layers * (4 * hidden * hidden + 3 * hidden * hidden + 2 * hidden) + 2 * 256 * hidden + hidden
    forward = 2 * heads * chunk * (tokens + 4) * 4
    return library, 4 * params + forward + FORWARD_BYTES


def activation_bytes(rows: int = workloads.ACTIVATIONS[2]) -> int:
    """Bytes of one saved activation of ``train_activations`` at ``rows`` rows."""
    width, _, _ = workloads.ACTIVATIONS
    return rows * width * 4


def measure(
    entry: str, shape: str, folder: Path, base: int, compare: bool = False
) -> tuple[Measured, memlimit.LimitedRun]:
    """Run ``entry`` confined to its bound + 10% (train_max_memory: to its bound, which it is given as max_memory=);
    with ``compare``, also unconfined, and check that both results (outputs, losses, tokens, files) are equal."""
    library, user = stated(entry, workloads.sizes(entry, shape))
    bound = base + library + user
    if entry == "train_max_memory":
        run = child(entry, shape, folder, bound, max_memory=bound)
    else:
        run = child(entry, shape, folder, bound + bound // 10)
    result = json.loads(run.stdout.splitlines()[-1])["result"] if run.returncode == 0 else None
    if compare and result is not None:
        free = child(entry, shape, folder, None, max_memory=bound)
        if free.returncode:
            raise RuntimeError(f"{entry} ({shape}) failed unconfined: {free.stderr[-3000:]}")
        expected = json.loads(free.stdout.splitlines()[-1])["result"]
        if result != expected:
            raise AssertionError(
                f"{entry} ({shape}): the confined result {result} differs from the unconfined {expected}"
            )
    return Measured(entry, shape, base, library, user, run.peak_bytes, result), run


def main(shapes: list[str]) -> None:
    import tempfile

    reason = memlimit.unavailable()
    if reason:
        raise SystemExit(reason)
    build_op()
    print(
        "| entry point | tensors | after imports | library (stated) | user (stated) | bound | peak | peak - imports |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in shapes:
        with tempfile.TemporaryDirectory(dir=os.environ.get("DEEPOFFLOAD_TEST_DIR")) as tmp:
            folder = Path(tmp)
            bases = {kind: baseline(folder, kind) for kind in sorted({imports(entry) for entry in ENTRIES})}
            for entry in ENTRIES:
                if entry in ONE_SHAPE and shape != "large":
                    continue
                prepare(shape, folder, [needs(entry)])
                m, run = measure(entry, shape, folder, bases[imports(entry)], compare=True)
                peak = "killed" if run.returncode else f"{m.peak / MiB:.0f} MiB"
                print(
                    f"| {entry} | {shape} | {m.base / MiB:.0f} MiB | {m.library / MiB:.0f} MiB | "
                    f"{m.user / MiB:.0f} MiB | {m.bound / MiB:.0f} MiB | {peak} | "
                    f"{(m.peak - m.base) / MiB:.0f} MiB |",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1:] or ["large", "small"])
