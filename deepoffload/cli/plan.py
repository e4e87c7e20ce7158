"""``deepoffload plan CHECKPOINT --max-memory N``: what streaming the checkpoint's model keeps in memory.

That is what ``offload_parameters(..., load=LoadOptions(checkpoint=CHECKPOINT), stream=StreamOptions(max_memory=N))``
would keep in memory, part by part, and its expected peak; or the least limit that works.

Blocks are read from the checkpoint's names: tensors sharing a prefix that ends in a number (``model.layers.3.``,
or ``3.`` for a top-level ``nn.Sequential``) form one block, as the children of an ``nn.ModuleList`` do; the rest
stays in memory. A ``torch.save`` file holding a dict with a state dict inside (``{"model": ..., "optimizer": ...}``,
as ``deepoffload.save`` writes a training checkpoint) is read through that state dict; ``--key`` names it where
several could be. The process's own memory is
measured here, after importing torch (and torch._dynamo, which a torch optimizer imports: with ``--train``), as
``offload_parameters`` measures it at its call; for a Hugging Face folder (with ``config.json``, read by
``deepoffload.from_pretrained``) after building its model on ``meta`` too, as ``from_pretrained`` does before that
call. A script holding more before the call needs more.
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
    from ..formats.registry import checkpoint_formats  # (imports no torch)

    readable = "; ".join(f"{f.description} ({f.name})" for f in checkpoint_formats() if f.reads)
    parser.add_argument("checkpoint", help=f"the checkpoint: {readable}")
    parser.add_argument(
        "--max-memory", required=True, metavar="N", help="the process's memory limit: bytes, or e.g. 6GB, 512MiB"
    )
    parser.add_argument("--prefetch", type=int, default=1, help="the most blocks read ahead (default: 1)")
    parser.add_argument("--train", action="store_true", help="with an optimizer (Adam-like state buffers)")
    parser.add_argument(
        "--folder",
        action="append",
        metavar="DIR",
        help="a swap folder; repeat for several drives: shows which drive each block goes to",
    )
    parser.add_argument(
        "--folder-speeds",
        metavar="GBPS,...",
        help="each folder's measured speed (what `tune --folder A --folder B` writes); default: equal shares",
    )
    parser.add_argument(
        "--key",
        metavar="KEY",
        help="a torch.save file holding a dict: the key of the model's state dict in it (found when only one is)",
    )


def blocks_of(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """({block prefix: bytes}, bytes outside blocks) from {tensor name: bytes}."""
    blocks: dict[str, int] = {}
    rest = 0
    for name, nbytes in sizes.items():
        match = re.match(r"((?:.*?\.)?\d+)\.", name)
        if match:
            blocks[match.group(1)] = blocks.get(match.group(1), 0) + nbytes
        else:
            rest += nbytes
    return blocks, rest


def _is_state_dict(value: object) -> bool:
    import torch

    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def _nested_state_dict(path: str, key: str | None) -> tuple[dict, str]:
    """The state dict inside the dict a ``torch.save`` file holds, and the key it is under.

    Args:
        path: The ``torch.save`` file.
        key: The key to read (None: the only state dict in it).

    Returns:
        (the state dict, its key).

    Raises:
        CheckpointError: When the file holds no such dict, ``key`` is not one, or several are and no ``key`` says
            which.
    """
    import torch

    from ..errors import CheckpointError

    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load it with torch.load(mmap=True, weights_only=True): {e}") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: holds a {type(saved).__name__}, not a state dict or a dict holding one")
    found = [k for k, v in saved.items() if isinstance(k, str) and _is_state_dict(v)]
    if key is not None:
        if not _is_state_dict(saved.get(key)):
            raise CheckpointError(f"{path}: --key {key!r} is not a state dict in it; state dicts under: {found}")
        return saved[key], key
    if len(found) == 1:
        return saved[found[0]], found[0]
    if not found:
        raise CheckpointError(f"{path}: a dict with keys {list(saved)[:10]}, none of them a state dict")
    raise CheckpointError(f"{path}: several state dicts, under {found}: pass --key with the model's")


def _sizes(path: str, key: str | None) -> tuple[dict[str, int], str]:
    """The sizes of a checkpoint's tensors, and its format.

    Args:
        path: The checkpoint (a safetensors file, a sharded folder, a torch.save file).
        key: The key of the state dict in a torch.save file holding a dict (None: found, where only one is).

    Returns:
        ({tensor name: bytes as stored}, its format or where they were found in a torch.save file:
        " (safetensors)" or " (the state dict under key 'k')").

    Raises:
        CheckpointError: When it cannot be read, or holds no state dict (see ``_nested_state_dict``).
        OSError: When it cannot be opened.
    """
    import math

    import torch

    from ..errors import CheckpointError
    from ..formats import CheckpointReader, detect_format, get_format
    from ..swap.pool import round_up
    from ..swap.records import TENSOR_ALIGNMENT

    def stored(shape, dtype) -> int:
        return round_up(math.prod(shape) * torch.empty((), dtype=dtype).element_size(), TENSOR_ALIGNMENT)

    if key is None:
        try:
            with CheckpointReader(path) as reader:
                return {name: stored(*reader.shape_dtype(name)) for name in reader.names()}, f" ({reader.format})"
        except CheckpointError:
            if detect_format(path) is not get_format("torch"):  # --key reads inside torch.save files only
                raise
    state, found = _nested_state_dict(path, key)
    return {name: stored(t.shape, t.dtype) for name, t in state.items()}, f" (the state dict under key {found!r})"


def _size(nbytes: int) -> str:
    """Bytes for reading: MB (1e6 bytes), or kB below a MB, so that a small model's figures are not 0.0."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 or nbytes == 0 else f"{nbytes / 1e3:.1f} kB"


def _mb(nbytes: int) -> str:
    return f"{_size(nbytes):>13}"


def _as_from_pretrained(path: str) -> bool:
    """Builds a Hugging Face folder's model on ``meta`` as ``from_pretrained`` does before fitting ``max_memory``.

    transformers and the model's code then count in the process's memory as they will at that call (they hold about
    100 MB; measured without them, the smallest limit named was too small for ``from_pretrained``).

    Args:
        path: The checkpoint given.

    Returns:
        Whether it was built (a folder with ``config.json`` that transformers can build, and transformers installed).
    """
    from pathlib import Path

    import torch

    if not (Path(path) / "config.json").is_file():
        return False
    try:
        from transformers import AutoConfig
    except ImportError:  # no transformers: no from_pretrained either, so the plan counts torch alone
        return False
    from ..integrations.hugging_face.pretrained import build_model, model_class_for

    try:  # a config transformers cannot build (unknown model_type, remote code): from_pretrained refuses it too
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            build_model(model_class_for(config, None), config)
    except Exception:  # what from_pretrained would refuse: plan as for a checkpoint alone
        return False
    return True


def _refusal(plan, limit: int, process: int, default_prefetch: int, process_label: str) -> list[str]:
    """The short table printed when even the least plan does not fit ``limit``.

    Args:
        plan: The plan of the model's sizes.
        limit: The limit given, in bytes.
        process: The process's memory now, in bytes.
        default_prefetch: The prefetch asked for (the default 1): the limit it needs is shown too.
        process_label: The process's row's label (what it holds).

    Returns:
        The lines to print.
    """
    from dataclasses import replace

    from ..swap.params.budget import FORWARD_BYTES, MIN_STATE_CHUNKS

    least = replace(plan, prefetch=0, state_chunks=MIN_STATE_CHUNKS, resident_bytes=0)
    default = replace(least, prefetch=default_prefetch)
    need = process + least.peak_bytes + FORWARD_BYTES
    rows = [
        f"does not fit: --max-memory {limit / 1e6:.1f} MB; the smallest that works is {need / 1e6:.1f} MB:",
        f"  {process_label:<58}{_mb(process)}",
        f"  {'the offload at its least (prefetch 0, nothing kept)':<58}{_mb(least.peak_bytes)}",
        f"  {'left for the forward activations':<58}{_mb(FORWARD_BYTES)}",
        f"  {'= the smallest --max-memory':<58}{_mb(need)}",
    ]
    if default_prefetch > 0:
        with_default = process + default.peak_bytes + FORWARD_BYTES
        rows.append(f"  {f'with --prefetch {default_prefetch}':<58}{_mb(with_default)}")
    return rows


def resident_blocks(blocks: dict[str, int], kept: int) -> list[str]:
    """The blocks ``max_resident_bytes`` keeps before anything ran: in block order, each while it fits ``kept``.

    That is what ``ResidentSet`` chooses with no runs counted, and for good when every block runs once per token
    (a decoder-only model); an encoder-decoder model's set moves to its decoder once it has run more.

    Args:
        blocks: {block prefix: bytes}.
        kept: Bytes of blocks the plan keeps in memory.

    Returns:
        The prefixes of the blocks kept, in block order (numbered parts compared as numbers).
    """
    order = sorted(blocks, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)])
    chosen = []
    for prefix in order:
        if blocks[prefix] <= kept:
            chosen.append(prefix)
            kept -= blocks[prefix]
    return chosen


def _per_token(blocks: dict[str, int], kept: int) -> list[str]:
    """The rows naming the blocks kept and the bytes one token of ``generate`` reads (the other blocks, once)."""
    resident = resident_blocks(blocks, kept)
    streamed = sum(n for p, n in blocks.items() if p not in set(resident))
    names = ", ".join(resident[:3]) + (f" ... {resident[-1]}" if len(resident) > 3 else "")
    return [
        f"per token (generate): {len(resident)} of {len(blocks)} blocks resident" + (f" ({names})" if names else ""),
        f"  read per token: {_size(streamed)} ({len(blocks) - len(resident)} blocks streamed, each read once; "
        f"stored bytes, before a codec)",
    ]


def _report(fitted, blocks: dict[str, int], process_label: str) -> list[str]:
    """The plan's figures, which add up.

    The running rows sum to the running total; the expected peak is the process now, the larger of loading and
    running, and the forward's activations.

    Args:
        fitted: The settings ``fit`` chose.
        blocks: {block prefix: bytes}.
        process_label: The process's row's label (what it holds).

    Returns:
        The lines to print.
    """
    from ..swap.params.budget import INFERENCE_BLOCKS, READER_BYTES, SETUP_BLOCKS, STATE_CHUNKS, TRAINING_BLOCKS

    plan, limit, process = fitted.plan, fitted.limit_bytes, fitted.process_bytes
    R = plan.rest_bytes
    kept = plan.resident_bytes or 0
    rest = R * (2 if plan.training else 1)
    working = TRAINING_BLOCKS if plan.training else INFERENCE_BLOCKS
    rows = [
        f"max_memory {limit / 1e6:.1f} MB: prefetch {plan.prefetch}"
        + (f", {plan.state_chunks} optimizer buffers" if plan.training else "")
        + f", {_size(kept)} of the {_size(sum(blocks.values()))} of blocks kept resident",
        f"  while running (B = {_size(plan.block_bytes)}: the largest block's staging span; R = outside blocks):",
        f"  {'outside blocks, resident: ' + ('R + its gradients' if plan.training else 'R'):<58}{_mb(rest)}",
        f"  {'blocks kept resident (max_resident_bytes)':<58}{_mb(kept)}",
        f"  {f'in flight: {plan.prefetch} read ahead + 1 computing + 1 written back, x B':<58}"
        f"{_mb(plan.staging_bytes)}",
        f"  {f'working: {working} B (' + ('gradients, temporaries' if plan.training else 'outputs') + ')':<58}"
        f"{_mb(plan.working_bytes)}",
    ]
    if plan.training:
        label = f"optimizer state staging: {plan.state_chunks} B + {STATE_CHUNKS} x min(B, R)"
        rows.append(f"  {label:<58}{_mb(plan.optimizer_bytes)}")
    rows += [
        f"  {'= running':<58}{_mb(plan.run_bytes)}",
        f"  {f'while loading: R + reader {READER_BYTES >> 20} MiB + {SETUP_BLOCKS} B':<58}{_mb(plan.setup_bytes)}",
        f"  {process_label:<58}{_mb(process)}",
        f"  {'the larger of running and loading':<58}{_mb(plan.peak_bytes)}",
        f"  {'left for the forward activations':<58}{_mb(fitted.forward_bytes)}",
        f"  {'= expected peak':<58}{_mb(fitted.expected_peak_bytes)}",
        f"  {'unused of --max-memory':<58}{_mb(limit - fitted.expected_peak_bytes)}",
    ]
    return rows


def run(args: argparse.Namespace) -> int:
    """Runs ``deepoffload plan``: reads the checkpoint's tensor sizes, fits the plan to the limit and prints it.

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0 when it fits, 1 when it does not (or the checkpoint cannot be read or has no blocks),
        2 for an unreadable ``--max-memory``.
    """
    from dataclasses import replace

    from ..errors import CheckpointError, MemoryBudgetError
    from ..swap.params.budget import READER_BYTES, MemoryPlan, fit, parse_bytes, process_bytes
    from ..swap.pool import round_up

    try:
        limit = parse_bytes(args.max_memory, "--max-memory")
    except (TypeError, ValueError) as e:
        print(f"deepoffload plan: {e}", file=sys.stderr)
        return 2
    try:
        sizes, where = _sizes(args.checkpoint, args.key)
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
    label = "the process now (torch imported)"
    if _as_from_pretrained(args.checkpoint):
        label = "the process now (as from_pretrained: model on meta)"
    process = process_bytes()
    print(
        f"checkpoint: {args.checkpoint}{where}: {len(blocks)} blocks, {_size(sum(blocks.values()))} in blocks "
        f"(the largest {_size(max(blocks.values()))}), {_size(rest)} outside"
    )
    try:
        fitted = fit(plan, limit, process)
    except MemoryBudgetError:
        print("\n".join(_refusal(plan, limit, process, args.prefetch, label)))
        return 1
    # fit() keeps as many bytes of blocks as the limit leaves room for; no more than the blocks hold
    kept = min(cast(int, fitted.plan.resident_bytes), sum(blocks.values()))
    fitted = replace(fitted, plan=replace(fitted.plan, resident_bytes=kept))
    print("\n".join(_report(fitted, blocks, label)))
    if not args.train:
        print("\n".join(_per_token(blocks, kept)))
    if args.folder:
        try:
            print("\n".join(_placement(args.folder, args.folder_speeds, blocks, args.train)))
        except (OSError, ValueError) as e:
            print(f"deepoffload plan: {e}", file=sys.stderr)
            return 1
    return 0


def _placement(folders: list[str], speeds: str | None, blocks: dict[str, int], train: bool) -> list[str]:
    """Which drive each block's swap file goes to, as the ``drives`` layout places them (blocks in run order).

    Args:
        folders: ``--folder``s.
        speeds: ``--folder-speeds`` (comma-separated GB/s), or None.
        blocks: {block prefix: bytes}.
        train: Whether optimizer state is placed too.

    Returns:
        The lines to print.

    Raises:
        OSError: When a folder is missing.
        ValueError: When the speeds are not one positive number per folder.
    """
    from ..swap.layouts.multi_folder import distinct_drives, placement

    weights = [float(x) for x in speeds.split(",")] if speeds else None
    kept, shares = distinct_drives(folders, weights)
    order = sorted(blocks, key=lambda b: [int(p) if p.isdigit() else p for p in b.split(".")])
    drives = placement(shares, len(order))
    lines = ["", f"placement over {len(kept)} drive{'s' if len(kept) != 1 else ''} (blocks in run order; each step "]
    lines[-1] += "reads and writes every drive at once):"
    for i, folder in enumerate(kept):
        mine = [b for b, d in zip(order, drives) if d == i]
        share = shares[i] / sum(shares)
        names = ", ".join(mine[:6]) + (f", ... ({len(mine)} blocks)" if len(mine) > 6 else "")
        lines.append(f"  drive {i}  {folder}  share {share:.2f}  {_mb(sum(blocks[b] for b in mine))}  {names}")
    if train:
        lines.append("  optimizer state: one pack file per drive, each new extent on the drive with the fewest bytes")
        lines[-1] += " per unit of share"
    return lines
