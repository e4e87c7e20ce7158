"""The module's persistent state streamed out of a ``ParameterOffload`` (for ``save``).

Each block's parameters are read from storage when reached, the rest is taken as it is in memory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ....formats.commit import install_files
from ..blocks.residency import Block
from .store import BlockStore


def state_items(module: nn.Module, blocks: list[Block], store: BlockStore) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the module's persistent state in ``state_dict()`` order, each block read when reached."""
    by_prefix = {b.prefix: b for b in blocks}
    seen: set[int] = set()

    def own(module: nn.Module, prefix: str, skip_params: bool) -> Iterator[tuple[str, torch.Tensor]]:
        if not skip_params:
            for name, param in module._parameters.items():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    yield prefix + name, param.detach()
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set and id(buffer) not in seen:
                seen.add(id(buffer))
                yield prefix + name, buffer

    def visit(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        block = by_prefix.get(prefix[:-1])
        if block is not None and block.module is module:
            values = store.read_copy(block)
            for name, param in zip(block.names, block.params):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield block.qualified(name), values[name]
            del values
            for name, sub in module.named_modules(prefix=prefix[:-1]):
                yield from own(sub, name + ".", skip_params=True)
            return
        yield from own(module, prefix, skip_params=False)
        for name, child in module.named_children():
            yield from visit(child, f"{prefix}{name}.")

    yield from visit(module, "")


def save_config(module: nn.Module, path: str | os.PathLike) -> None:
    """Write a module's ``config`` (one with ``save_pretrained``, as Hugging Face models have) into ``path``.

    Written aside first and renamed in: ``config.save_pretrained`` writes in place, so a kill would leave it half
    written.

    Args:
        module: The module.
        path: The checkpoint folder.
    """
    config = getattr(module, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        with tempfile.TemporaryDirectory() as staging:
            config.save_pretrained(staging)
            install_files(Path(staging), Path(path))
