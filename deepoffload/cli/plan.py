"""``deepoffload plan CHECKPOINT --max-memory N``: what streaming the checkpoint's model keeps in memory.

That is what ``offload_parameters(..., checkpoint=CHECKPOINT, max_memory=N)`` would keep in memory, part by part,
and its expected peak; or the least limit that works.

Blocks are read from the checkpoint's names: tensors sharing a prefix that ends in a number (``model.layers.3.``)
form one block, as the children of an ``nn.ModuleList`` do; the rest stays in memory. The process's own memory is
measured here, after importing torch (and torch._dynamo, which a torch optimizer imports: with ``--train``), as
``offload_parameters`` measures it at its call; a training script holding more before the call needs more.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import cast


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``deepoffload plan``'s options to ``parser``.

    Args:
        parser: The command's subparser.
    """
    parser.add_argument("checkpoint", help="a .safetensors file, a sharded folder with its index, or a torch.save file")
    parser.add_argument(
        "--max-memory", required=True, metavar="N", help="the process's memory limit: bytes, or e.g. 6GB, 512MiB"
    )
    parser.add_argument("--prefetch", type=int, default=1, help="the most blocks read ahead (default: 1)")
    parser.add_argument("--train", action="store_true", help="with an optimizer (Adam-like state buffers)")


def blocks_of(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """({block prefix: bytes}, bytes outside blocks) from {tensor name: bytes}."""
    blocks: dict[str, int] = {}
    rest = 0
    for name, nbytes in sizes.items():
        match = re.match(r"(.*?\.\d+)\.", name)
        if match:
            blocks[match.group(1)] = blocks.get(match.group(1), 0) + nbytes
        else:
            rest += nbytes
    return blocks, rest


def run(args: argparse.Namespace) -> int:
    """Runs ``deepoffload plan``: reads the checkpoint's tensor sizes, fits the plan to the limit and prints it.

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0 when it fits, 1 when it does not (or the checkpoint cannot be read or has no blocks),
        2 for an unreadable ``--max-memory``.
    """
    import math

    import torch

    from ..errors import CheckpointError, MemoryBudgetError
    from ..formats import CheckpointReader
    from ..swap.params.budget import READER_BYTES, MemoryPlan, fit, parse_bytes, process_bytes
    from ..swap.pool import round_up
    from ..swap.records import TENSOR_ALIGNMENT

    try:
        limit = parse_bytes(args.max_memory, "--max-memory")
    except (TypeError, ValueError) as e:
        print(f"deepoffload plan: {e}", file=sys.stderr)
        return 2
    try:
        with CheckpointReader(args.checkpoint) as reader:
            sizes = {}
            for name in reader.names():
                shape, dtype = reader.shape_dtype(name)
                sizes[name] = round_up(math.prod(shape) * torch.empty((), dtype=dtype).element_size(), TENSOR_ALIGNMENT)
    except (CheckpointError, OSError) as e:
        print(f"deepoffload plan: {e}", file=sys.stderr)
        return 1
    blocks, rest = blocks_of(sizes)
    if not blocks:
        print(
            f"deepoffload plan: {args.checkpoint}: no blocks (names with a numbered part such as layers.0.)",
            file=sys.stderr,
        )
        return 1
    if args.train:
        import torch._dynamo  # noqa: F401  (what a torch optimizer's construction imports)
    plan = MemoryPlan(
        round_up(max(blocks.values())),
        rest,
        args.prefetch,
        training=args.train,
        resident_bytes=None,
        reader_bytes=READER_BYTES,
    )
    process = process_bytes()
    print(
        f"checkpoint: {args.checkpoint}: {len(blocks)} blocks, {sum(blocks.values()) / 1e6:.1f} MB in blocks, "
        f"{rest / 1e6:.1f} MB outside"
    )
    try:
        fitted = fit(plan, limit, process)
    except MemoryBudgetError as e:
        print(f"does not fit: {e}")
        return 1
    print(
        f"max_memory: {limit / 1e6:.1f} MB; the process now: {process / 1e6:.1f} MB; left for the forward's "
        f"activations: {fitted.forward_bytes / 1e6:.1f} MB"
    )
    print(
        f"chosen: prefetch {fitted.plan.prefetch}, {fitted.plan.state_chunks} optimizer buffers, "
        f"{cast(int, fitted.plan.resident_bytes) / 1e6:.1f} MB of blocks kept in memory"
    )  # fit() sets it
    for what, nbytes in fitted.plan.parts():
        print(f"  {what}: {nbytes / 1e6:.1f} MB")
    print(f"expected peak: {fitted.expected_peak_bytes / 1e6:.1f} MB of {limit / 1e6:.1f} MB")
    return 0
