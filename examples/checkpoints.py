"""Checkpoints through deepoffload's op: ``save``/``load``/``save_async`` in ``torch.save``'s own format,
safetensors files and Hugging Face shards (``deepoffload.formats``), and ``torch.distributed.checkpoint`` storage
(``deepoffload.dcp``). Every file is checked against what torch, safetensors or DCP read back.

    python examples/checkpoints.py [--folder /nvme/ckpt] [--width 2048] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import safetensors.torch
import torch

import deepoffload


def training_state(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "step": 1}
    return model, opt, state


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", default=None, help="where checkpoints go (your NVMe); default: a temp folder")
    parser.add_argument("--width", type=int, default=2048, help="model width (checkpoint of ~12 x width^2 bytes)")
    parser.add_argument("--tiny", action="store_true", help="a few seconds: width 64")
    args = parser.parse_args(argv)
    if args.tiny:
        args.width = 64
    checks = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or scratch
        model, opt, state = training_state(args.width)

        # --8<-- [start:save]
        deepoffload.save(state, f"{folder}/ckpt.pt")  # instead of torch.save: the same bytes
        loaded = deepoffload.load(f"{folder}/ckpt.pt", map_location="cpu")  # instead of torch.load

        future = deepoffload.save_async(state, f"{folder}/ckpt.pt")  # returns once the state is copied
        # ... train on meanwhile: the state may change now ...
        future.result()  # the path, or the write's OSError
        # --8<-- [end:save]
        checks["save/load round trip"] = equal(loaded, state)
        checks["torch.load reads save's file"] = equal(torch.load(f"{folder}/ckpt.pt", weights_only=False), state)

        # --8<-- [start:safetensors]
        from deepoffload.formats import CheckpointReader, load_file, save_sharded

        save_sharded(model.state_dict().items(), f"{folder}/model", max_shard_bytes=model[0].weight.nbytes)
        weights = load_file(f"{folder}/model")  # every tensor, as a dict
        with CheckpointReader(f"{folder}/model") as reader:  # headers validated, nothing read yet
            reader.check(model.state_dict())  # names and shapes, one error listing all
            first = reader.read(["0.weight", "0.bias"], dtype=torch.bfloat16)  # only these are read
        # --8<-- [end:safetensors]
        checks["safetensors shards"] = equal(weights, model.state_dict())
        checks["read with dtype"] = equal(first["0.weight"], model[0].weight.detach().to(torch.bfloat16))
        index = json.loads(Path(f"{folder}/model/model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        theirs = {}
        for shard in shards:
            theirs.update(safetensors.torch.load_file(f"{folder}/model/{shard}"))
        checks["safetensors reads our shards"] = equal(theirs, model.state_dict())

        # --8<-- [start:dcp]
        import torch.distributed.checkpoint as dcp

        from deepoffload.dcp import FileSystemReader, FileSystemWriter

        dcp.save(model.state_dict(), storage_writer=FileSystemWriter(f"{folder}/dcp"), no_dist=True)
        restored = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        dcp.load(restored, storage_reader=FileSystemReader(f"{folder}/dcp"), no_dist=True)
        # --8<-- [end:dcp]
        checks["DCP round trip"] = equal(restored, model.state_dict())
    for name, ok in checks.items():
        print(f"{name}: {'ok' if ok else 'WRONG'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
