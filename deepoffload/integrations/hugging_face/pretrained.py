"""``deepoffload.from_pretrained(folder, path, train=, load=, stream=)``: a Hugging Face model folder loaded streamed.

The folder (``config.json`` and safetensors weights, sharded or not) is built on the ``meta`` device and loaded block
by block, so the model is never whole in memory. transformers is imported only when it runs.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ...errors import CheckpointNotFoundError
from ...swap.config import SwapConfig
from ...swap.params.api import offload_parameters
from ...swap.params.offload import ParameterOffload
from ...swap.params.options import LoadOptions, StreamOptions, TrainOptions, check_options, moved_keywords


def model_class_for(config: Any, model_class: Any) -> Any:
    """The class ``from_pretrained`` builds for a transformers ``config``.

    Args:
        config: A transformers ``PretrainedConfig``.
        model_class: The class asked for, or None.

    Returns:
        ``model_class`` when given, else the first of the config's ``architectures`` that transformers has, else
        ``transformers.AutoModel``.
    """
    import transformers

    if model_class is not None:
        return model_class
    for name in getattr(config, "architectures", None) or ():
        found = getattr(transformers, name, None)
        if found is not None:
            return found
    return transformers.AutoModel


def build_model(model_class: Any, config: Any) -> nn.Module:
    """``model_class`` built from ``config`` as transformers builds it (under the caller's default device).

    Args:
        model_class: A transformers model class or an ``AutoModel*`` class.
        config: Its config.

    Returns:
        The model, its weights initialised as the class does (on the meta device under ``torch.device("meta")``).
    """
    if hasattr(model_class, "from_config"):  # an AutoModel* class
        return model_class.from_config(config)
    if hasattr(model_class, "_from_config"):
        return model_class._from_config(config)
    return model_class(config)


@moved_keywords
def from_pretrained(
    folder: str | os.PathLike,
    /,
    model_class: Any = None,
    *,
    path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    train: TrainOptions | None = None,
    load: LoadOptions | None = None,
    stream: StreamOptions | None = None,
    config: SwapConfig | None = None,
) -> tuple[nn.Module, ParameterOffload]:
    """Build the model of a Hugging Face folder on the ``meta`` device and load its weights streamed.

    The model is built from the folder's ``config.json`` and loaded by ``offload_parameters(model, path,
    load=LoadOptions(checkpoint=folder, ...), ...)``, so it is never whole in memory.

    Args:
        folder: A ``save_pretrained`` folder: ``config.json`` and safetensors weights, sharded or not.
        model_class: The class to build (a model class or any ``AutoModel*`` class); default: the class named first
            in the config's ``architectures``, else ``AutoModel``.
        path: The swap folder, or a list of them, one per drive (see ``offload_parameters``).
        train: To train, a ``TrainOptions`` (see ``offload_parameters``). None: inference only.
        load: A ``LoadOptions`` without ``checkpoint`` (the checkpoint is ``folder``, read through transformers' own
            key renaming and conversion rules: GPT-NeoX's ``embed_out``, per-expert MoE weights,
            ``base_model_prefix``). Its ``dtype`` is the parameters' dtype (default: the class's as built, float32;
            transformers 5 defaults to the config's dtype, so pass it to load a half-precision folder as
            transformers does), except those transformers keeps in float32 (the model's ``_keep_in_fp32_modules``).
            Non-persistent buffers (rotary ``inv_freq``, BERT's ``position_ids``) are computed by the model's
            ``_init_weights``; weights the folder lacks are refused unless ``init`` names them
            (``LoadOptions(init=["classifier.*"])`` initializes them as transformers does).
        stream: A ``StreamOptions`` (see ``offload_parameters``).
        config: A ``SwapConfig`` (see ``offload_parameters``).

    Returns:
        The model (in eval mode, as ``from_pretrained`` returns it) and its ``ParameterOffload``.

    Raises:
        TypeError: When ``load`` holds a ``checkpoint`` (the checkpoint is ``folder``), or a keyword moved into an
            options object is given.
        CheckpointNotFoundError: When ``folder`` has no ``config.json`` (also a ``FileNotFoundError``).
        CheckpointError: When the folder's tensors do not match the model's (see ``offload_parameters``).

    Examples:
        >>> import contextlib, io, torch, transformers, deepoffload
        >>> config = transformers.LlamaConfig(
        ...     vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
        ... )
        >>> with contextlib.redirect_stdout(io.StringIO()):  # (a library may log to stdout while saving)
        ...     transformers.LlamaForCausalLM(config).save_pretrained("tiny-llama")
        >>> model, off = deepoffload.from_pretrained("tiny-llama", path="swap")
        >>> type(model).__name__, model.training
        ('LlamaForCausalLM', False)
        >>> [block.prefix for block in off.blocks]  # streamed from "swap"
        ['model.layers.0', 'model.layers.1']
        >>> with off, torch.no_grad():
        ...     model(torch.tensor([[1, 2, 3]])).logits.shape
        torch.Size([1, 3, 64])
    """
    from transformers import AutoConfig

    folder = Path(folder)
    if isinstance(load, LoadOptions) and load.checkpoint is not None:
        raise TypeError(
            "from_pretrained: the checkpoint is the folder given; pass a LoadOptions without checkpoint= "
            f"(got checkpoint={os.fspath(load.checkpoint)!r})"
        )
    check_options(load=load, train=train, stream=stream)
    if not (folder / "config.json").is_file():
        raise CheckpointNotFoundError(
            errno.ENOENT,
            "from_pretrained: no config.json (expected a save_pretrained folder)",
            str(folder / "config.json"),
        )
    hf_config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = build_model(model_class_for(hf_config, model_class), hf_config)
    load = (load or LoadOptions()).replace(checkpoint=folder)
    offload = offload_parameters(model, path, train=train, load=load, stream=stream, config=config)
    model.eval()
    return model, offload
