"""``deepoffload.from_pretrained(path, **offload options)``: a Hugging Face model folder loaded streamed.

The folder (``config.json`` and safetensors weights, sharded or not) is built on the ``meta`` device and loaded block
by block, so the model is never whole in memory. transformers is imported only here.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointNotFoundError
from .api import offload_parameters
from .offload import ParameterOffload


def _model_class(config: Any, model_class: Any) -> Any:
    import transformers

    if model_class is not None:
        return model_class
    for name in getattr(config, "architectures", None) or ():
        found = getattr(transformers, name, None)
        if found is not None:
            return found
    return transformers.AutoModel


def _build(model_class: Any, config: Any) -> nn.Module:
    if hasattr(model_class, "from_config"):  # an AutoModel* class
        return model_class.from_config(config)
    if hasattr(model_class, "_from_config"):
        return model_class._from_config(config)
    return model_class(config)


def from_pretrained(
    folder: str | os.PathLike, /, model_class: Any = None, *, dtype: torch.dtype | None = None, **options: Any
) -> tuple[nn.Module, ParameterOffload]:
    """Build the model of a Hugging Face folder on the ``meta`` device and load its weights streamed.

    The model is built from the folder's ``config.json`` and loaded by ``offload_parameters(model,
    checkpoint=folder, ...)``, so it is never whole in memory.

    Args:
        folder: A ``save_pretrained`` folder: ``config.json`` and safetensors weights, sharded or not.
        model_class: The class to build (a model class or any ``AutoModel*`` class); default: the class named first
            in the config's ``architectures``, else ``AutoModel``.
        dtype: Floating-point parameters get this dtype (default: the class's as built, float32; transformers 5
            defaults to the config's dtype, so pass it to load a half-precision folder as transformers does), except
            those transformers keeps in float32 (the model's ``_keep_in_fp32_modules``, by its own dtype plan).
        **options: ``offload_parameters`` keyword arguments (``path=`` the swap folder, ``mode``, ``optimizer``,
            ``compute_dtype``, ``max_resident_bytes``, ``serve_from_checkpoint``, ``strict``, ``init``, ...);
            ``checkpoint`` is ``folder``, read through transformers' own key renaming and conversion rules (GPT-NeoX's
            ``embed_out``, per-expert MoE weights, ``base_model_prefix``), and non-persistent buffers (rotary
            ``inv_freq``, BERT's ``position_ids``) are computed by the model's ``_init_weights``. Weights the folder
            lacks are refused unless ``init=`` names them (``init=["classifier.*"]`` initializes them as
            transformers does).

    Returns:
        The model (in eval mode, as ``from_pretrained`` returns it) and its ``ParameterOffload``.

    Raises:
        TypeError: When ``options`` hold a ``checkpoint`` (the checkpoint is ``folder``).
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
    if "checkpoint" in options:
        raise TypeError("from_pretrained: the checkpoint is the folder given; pass no checkpoint=")
    if not (folder / "config.json").is_file():
        raise CheckpointNotFoundError(
            errno.ENOENT,
            "from_pretrained: no config.json (expected a save_pretrained folder)",
            str(folder / "config.json"),
        )
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = _build(_model_class(config, model_class), config)
    swap = options.pop("path", None)
    offload = offload_parameters(model, swap, checkpoint=folder, dtype=dtype, **options)
    model.eval()
    return model, offload
