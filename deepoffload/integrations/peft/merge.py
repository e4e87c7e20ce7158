"""``save_merged(offload, folder)``: a streamed base with its LoRA adapters merged, written to a new folder.

PEFT's ``merge_and_unload`` adds each adapter's delta into its base weight in place; over a base served read-only from
its checkpoint (``serve_from_checkpoint=True``) that would write into the user's checkpoint, and over swap files it
would change values that are read again, so both are refused (naming this function). Here each block is read from
storage one at a time, each wrapped weight gets its delta added as PEFT's ``merge`` adds it (``weight += delta``, the
same arithmetic, so the values are bit-identical to ``merge_and_unload`` in memory:
``tests/integrations/peft/test_peft_merge.py``), and the result is written under the base's own names with
``save_sharded``; the served checkpoint is only read.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from ...errors import UnsupportedError
from ...formats.commit import install_files
from ...formats.writer import save_sharded
from ...swap.params.offload import ParameterOffload
from ...swap.params.storage.export import state_items


def lora_layers(offload: ParameterOffload) -> dict[str, Any]:
    """The LoRA layers wrapping streamed weights, by the base weight's name in the checkpoint.

    Args:
        offload: The offload of the model PEFT wrapped.

    Returns:
        ``{base weight's qualified name: its LoRA layer}`` for every streamed ``weight`` a LoRA layer wraps.

    Raises:
        UnsupportedError: When a LoRA layer cannot be merged exactly here (DoRA, a LoRA bias, an adapter outside
            the streamed blocks, or one already merged).
    """
    from peft.tuners.lora import LoraLayer

    layers = {
        id(m.get_base_layer().weight): (name, m)
        for name, m in offload.module.named_modules()
        if isinstance(m, LoraLayer)
    }
    found: dict[str, Any] = {}
    for block in offload.blocks:
        for name, param in zip(block.names, block.params):
            if id(param) in layers:
                found[block.qualified(name)] = layers.pop(id(param))[1]
    for name, layer in [*layers.values(), *((n, m) for n, m in found.items())]:
        problem = _why_not(layer)
        if problem:
            raise UnsupportedError(f"save_merged: LoRA layer of {name}: {problem}")
    if layers:
        name = next(iter(layers.values()))[0]
        raise UnsupportedError(f"save_merged: the LoRA layer {name} wraps no streamed parameter")
    return found


def _why_not(layer: Any) -> str | None:
    if layer.merged:
        return "already merged (merge_adapter()); unmerge_adapter() first"
    for adapter in layer.active_adapters:
        if layer.use_dora.get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
            return f"adapter {adapter!r} uses DoRA or a LoRA bias, which save_merged does not merge; merge in memory"
        if adapter not in layer.lora_A:
            return f"adapter {adapter!r} is not a LoRA adapter of a linear layer; merge in memory"
    return None


def merged_items(offload: ParameterOffload) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's ``state_dict()`` items under the base's names, each wrapped weight with its adapters merged.

    Args:
        offload: The offload of the model PEFT wrapped.

    Yields:
        (name, tensor): the blocks' values read one block at a time, the LoRA weights themselves left out.
    """
    layers = lora_layers(offload)
    with torch.no_grad():
        # the blocks' parameters come under their names at offloading (the base's), their adapters are left out
        for name, tensor in state_items(offload.module, offload.blocks, offload.store):
            layer = layers.get(name)
            if layer is not None:
                for adapter in layer.active_adapters:
                    tensor += layer.get_delta_weight(adapter)  # as peft's Linear.merge: base_layer.weight.data += delta
            yield name, tensor


def save_merged(
    offload: ParameterOffload, folder: str | os.PathLike, *, max_shard_bytes: int = 5 * 10**9
) -> list[Path]:
    """Write a streamed base with its LoRA adapters merged into ``folder``: what ``merge_and_unload()`` would give.

    The base's checkpoint (served or not) is only read; ``folder`` gets safetensors shards under the base's names and
    the model's ``config.json``, so ``transformers``' or ``deepoffload``'s ``from_pretrained(folder)`` loads the
    merged model. The values equal those of ``merge_and_unload()`` on the same model in memory, bit for bit
    (``tests/integrations/peft/test_peft_merge.py``).

    Args:
        offload: The ``ParameterOffload`` of the base that PEFT wrapped (``get_peft_model`` or
            ``PeftModel.from_pretrained`` over the streamed model).
        folder: A new folder to write (not the served checkpoint's).
        max_shard_bytes: The most bytes of one shard.

    Returns:
        The shard paths.

    Raises:
        UnsupportedError: When ``folder`` holds the served checkpoint, or a LoRA layer cannot be merged here (see
            ``lora_layers``).
    """
    target = Path(folder).resolve()
    for block in offload.blocks:
        if block.served and Path(block.served).resolve().parent == target:
            raise UnsupportedError(
                f"save_merged: {folder} holds the checkpoint the base is served from, which is never written; "
                f"pass a new folder"
            )
    offload.flush()
    shards = save_sharded(merged_items(offload), folder, max_shard_bytes=max_shard_bytes)
    config = getattr(offload.module, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        with tempfile.TemporaryDirectory() as staging:
            config.save_pretrained(staging)
            install_files(Path(staging), Path(folder))
    return shards
