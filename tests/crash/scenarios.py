"""The save paths the crash-point harness kills: each writes an "old" checkpoint (``setup``), then a "new" one
(``act``, the step that is killed), and knows how to load what is there (``load``) with a reader that follows the
files' own structure (for a sharded folder also ``safetensors`` driven by the index, as ``transformers`` reads it).

Every path writes under ``work`` only: the checkpoint as ``work/ckpt...`` and swap files under ``work/swap``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


def values(version: int, count: int = 4, numel: int = 3000) -> dict[str, torch.Tensor]:
    """Distinct tensors per version; the same names, shapes and dtypes in every version (the layout of a re-save
    of a trained model, where a mix of versions would load without error)."""
    g = torch.Generator().manual_seed(version)
    return {f"w{i}": torch.randn(numel, generator=g) for i in range(count)}


# -- single files ------------------------------------------------------------------------------------------------
def save_act(work: Path, version: int) -> None:
    import deepoffload

    deepoffload.save({"step": version, "model": values(version)}, work / "ckpt.pt")


def save_async_act(work: Path, version: int) -> None:
    import deepoffload

    deepoffload.save_async({"step": version, "model": values(version)}, work / "ckpt.pt").result()


def torch_load(work: Path) -> Any:
    import deepoffload

    return deepoffload.load(work / "ckpt.pt")


def save_file_act(work: Path, version: int) -> None:
    from deepoffload.formats import save_file

    save_file(values(version), work / "ckpt.safetensors")


def safetensors_load(work: Path) -> Any:
    from deepoffload.formats import load_file

    return load_file(work / "ckpt.safetensors")


# -- folders -----------------------------------------------------------------------------------------------------
def save_sharded_act(work: Path, version: int) -> None:
    from deepoffload.formats import save_sharded

    save_sharded(values(version), work / "ckpt", max_shard_bytes=3000 * 4)


def sharded_load(work: Path) -> Any:
    """Both readers' views: this package's and safetensors' driven by the index (the one transformers uses)."""
    from safetensors.torch import load_file as st_load_file

    from deepoffload.formats import load_file

    folder = work / "ckpt"
    ours = load_file(folder)
    index = folder / "model.safetensors.index.json"
    theirs: dict[str, torch.Tensor] = {}
    if index.exists():
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            theirs.update(st_load_file(folder / shard))
    else:
        theirs = st_load_file(folder / "model.safetensors")
    return {"ours": ours, "safetensors": theirs}


def _block_model(version: int) -> nn.Module:
    torch.manual_seed(version)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])


def offload_save_act(work: Path, version: int) -> None:
    import deepoffload

    off = deepoffload.offload_parameters(_block_model(version), str(work / "swap"))
    try:
        off.save(work / "ckpt")
    finally:
        off.close(restore=False)


def offload_save_sharded_act(work: Path, version: int) -> None:
    """``off.save`` into several shards and an index (each block's weight and bias in a shard of its own)."""
    import deepoffload

    off = deepoffload.offload_parameters(_block_model(version), str(work / "swap"))
    try:
        off.save(work / "ckpt", max_shard_bytes=32 * 32 * 4)
    finally:
        off.close(restore=False)


def offload_save_config_act(work: Path, version: int) -> None:
    """``off.save`` of a model with a Hugging Face config: the shards, then transformers' own ``config.json``."""
    from transformers import PretrainedConfig

    import deepoffload

    model = _block_model(version)
    model.config = PretrainedConfig(hidden_size=32, num_hidden_layers=4)  # the same in both saves, as on a re-save
    off = deepoffload.offload_parameters(model, str(work / "swap"))
    try:
        off.save(work / "ckpt")
    finally:
        off.close(restore=False)


def config_folder_load(work: Path) -> Any:
    """The weights, and the config as transformers reads it back (a half-written ``config.json`` raises)."""
    from transformers import PretrainedConfig

    from deepoffload.formats import load_file

    config = PretrainedConfig.from_pretrained(work / "ckpt")
    return {"weights": load_file(work / "ckpt"), "config": (config.hidden_size, config.num_hidden_layers)}


def budget_act(work: Path, version: int) -> None:
    """Train with every block in memory, then drop the budget (the blocks are written out), then save."""
    import deepoffload

    model = _block_model(version)
    off = deepoffload.offload_parameters(
        model,
        str(work / "swap"),
        train=deepoffload.TrainOptions(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)),
        stream=deepoffload.StreamOptions(max_resident_bytes=1 << 30),
    )
    try:
        for _ in range(2):
            model(torch.ones(2, 32)).sum().backward()
            off.step()
        off.set_max_resident_bytes(0)
        off.save(work / "ckpt")
    finally:
        off.close(restore=False)


def optimizer_act(work: Path, version: int) -> None:
    """Offloaded optimizer steps (their state written to swap files), then model and optimizer state saved."""
    import deepoffload

    model = _block_model(version)
    opt = deepoffload.OffloadedOptimizer(
        torch.optim.Adam,
        model.parameters(),
        lr=0.01,
        config=deepoffload.SwapConfig(folder=str(work / "swap"), pin=False),
    )
    try:
        for _ in range(2):
            model(torch.ones(2, 32)).sum().backward()
            opt.step()
        deepoffload.save({"model": model.state_dict(), "opt": opt.state_dict()}, work / "ckpt.pt")
    finally:
        opt.close()


SECOND_DRIVE = "DEEPOFFLOAD_TEST_SECOND_DRIVE"  # a folder on a device of its own (the test mounts one), listed too


def two_drives_act(work: Path, version: int) -> None:
    """Fused training with blocks and optimizer state spread over two drives' swap folders, then ``off.save``."""
    import deepoffload

    (work / "swap").mkdir(exist_ok=True)  # (with several folders each must exist)
    second = os.environ.get(SECOND_DRIVE) or str(work / "swap")  # without one: the same device, counted once
    model = _block_model(version)
    off = deepoffload.offload_parameters(
        model,
        [str(work / "swap"), second] if second != str(work / "swap") else str(work / "swap"),
        train=deepoffload.TrainOptions(optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01)),
    )
    try:
        model(torch.ones(2, 32)).sum().backward()
        off.save(work / "ckpt")
    finally:
        off.close(restore=False)


def scaled_overflow_act(work: Path, version: int) -> None:
    """Grads-mode training through a ``GradScaler``: a step, then one whose scaled gradients overflow (skipped: the
    weights, the optimizer state and their swap files must not change, checked here), then ``off.save``."""
    import deepoffload
    from deepoffload.swap.params import StreamedOptimizer

    model = _block_model(version)
    train = deepoffload.TrainOptions(lambda ps: torch.optim.Adam(ps, lr=0.01), mode="grads")
    off = deepoffload.offload_parameters(model, str(work / "swap"), train=train)
    try:
        opt, scaler = StreamedOptimizer(off), torch.amp.GradScaler("cpu")
        for scale in (None, 3e38):  # the second scale overflows the float32 loss
            if scale is not None:
                scaler.update(new_scale=scale)
                before, files = off.state_dict(), {p: p.read_bytes() for p in (work / "swap").rglob("*.swp")}
            scaler.scale(model(torch.ones(2, 32)).pow(2).sum() * 1e3).backward()  # gradients times 3e38: inf
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        after = off.state_dict()
        if any(not torch.equal(before[k], after[k]) for k in before) or files != {
            p: p.read_bytes() for p in (work / "swap").rglob("*.swp")
        }:
            raise RuntimeError("an overflowing GradScaler step changed the weights or a swap file")
        off.save(work / "ckpt")
    finally:
        off.close(restore=False)


# -- DCP -----------------------------------------------------------------------------------------------------------
def dcp_act(work: Path, version: int) -> None:
    import torch.distributed.checkpoint as dcp

    from deepoffload.dcp import FileSystemWriter

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(values(version)), storage_writer=FileSystemWriter(work / "ckpt", overwrite=True), no_dist=True)


def dcp_load(work: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    target = {name: torch.zeros_like(t) for name, t in values(0).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=dcp.FileSystemReader(work / "ckpt"), no_dist=True)  # DCP's own reader
    return target


def sharded_folder_load(work: Path) -> Any:
    from deepoffload.formats import load_file

    return load_file(work / "ckpt")


def _served(work: Path):
    """``work/ckpt.safetensors`` served with the lossless codec (its compressed copy under ``work/swap``)."""
    import deepoffload
    from deepoffload import LoadOptions, SwapConfig

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]).to(torch.bfloat16)
    load = LoadOptions(checkpoint=str(work / "ckpt.safetensors"), serve_from_checkpoint=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("writing a compressed copy ...")
        off = deepoffload.offload_parameters(model, str(work / "swap"), load=load, config=SwapConfig(codec="lossless"))
    return model, off


def compressed_copy_act(work: Path, version: int) -> None:
    """Save checkpoint ``version``, serve it with a codec: its compressed copy is (re)built, then read."""
    from deepoffload.formats import save_file

    save_file(
        {k: v.to(torch.bfloat16) for k, v in _block_model(version).state_dict().items()}, work / "ckpt.safetensors"
    )
    (work / "swap").mkdir(exist_ok=True)
    model, off = _served(work)
    try:
        off.store.copy.start()
        if not off.store.copy.wait():
            raise RuntimeError(f"no compressed copy: {off.store.copy.error!r}")
        with torch.no_grad():
            model(torch.ones(2, 32, dtype=torch.bfloat16))
    finally:
        off.close(restore=False)


def compressed_copy_load(work: Path) -> Any:
    """The next run serves exactly the checkpoint's values (from a whole matching copy or the checkpoint): the
    checkpoint's values when a forward equals the model's in memory, else a string saying it does not."""
    from deepoffload.formats import load_file

    values = load_file(work / "ckpt.safetensors")
    reference = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]).to(torch.bfloat16)
    reference.load_state_dict(values)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    model, off = _served(work)
    try:
        with torch.no_grad():
            same_out = torch.equal(model(x), reference(x)) and torch.equal(model(x), reference(x))
    finally:
        off.close(restore=False)
    return values if same_out else "the served values differ from the checkpoint's"


SCENARIOS: dict[str, tuple[Callable[[Path, int], None], Callable[[Path], Any]]] = {
    "save": (save_act, torch_load),
    "save_async": (save_async_act, torch_load),
    "save_file": (save_file_act, safetensors_load),
    "save_sharded": (save_sharded_act, sharded_load),
    "offload_save": (offload_save_act, sharded_folder_load),
    "offload_save_sharded": (offload_save_sharded_act, sharded_folder_load),
    "offload_save_config": (offload_save_config_act, config_folder_load),
    "dcp": (dcp_act, dcp_load),
    "optimizer_step": (optimizer_act, torch_load),
    "max_resident_bytes": (budget_act, sharded_folder_load),
    "two_drives": (two_drives_act, sharded_folder_load),
    "scaled_overflow": (scaled_overflow_act, sharded_folder_load),
    "compressed_copy": (compressed_copy_act, compressed_copy_load),
}


def same(a: Any, b: Any) -> bool:
    """Deep equality of loaded checkpoints (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def listing(work: Path) -> list[str]:
    """Every file and folder under ``work``, with the 8-hex-digit generations of names made comparable."""
    import re

    names = []
    second = os.environ.get(SECOND_DRIVE)
    for top, prefix in ((work, ""), *(((Path(second), "second drive/"),) if second else ())):
        for root, folders, files in os.walk(top):
            for name in folders + files:
                names.append(prefix + re.sub(r"[0-9a-f]{8}", "G", os.path.relpath(os.path.join(root, name), top)))
    return sorted(names)
