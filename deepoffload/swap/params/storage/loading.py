"""``model.load_state_dict(...)`` on a streamed model: each block's entries are written to its stored values.

The entries go to the blocks' master values, so resuming (``Trainer(resume_from_checkpoint=...)``, accelerate's
``load_state``, a plain ``load_state_dict``) gives the values loading in memory gives.

A load-state-dict pre-hook on each block takes the block's entries out of the state dict before PyTorch copies them
parameter by parameter (which would meet placeholders, or compute copies its masters cannot take): a block on
storage is read, its masters set (``copy_``, converting the dtype as in memory) and written back; a block held in
memory (pinned, kept) has its masters set in place and its compute copies cast again. Entries whose shape differs
from the stored one stay for PyTorch to report. A post-hook takes the entries it wrote off the missing keys. A block
served read-only from a checkpoint (``serve_from_checkpoint=True``) refuses a load: the checkpoint is never written.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ....errors import CheckpointError, UnsupportedError
from ..blocks.placeholders import internal
from ..blocks.residency import Block, Residency
from .store import BlockStore


def load_hooks(store: BlockStore, block: Block) -> tuple[Callable, Callable]:
    """The (pre, post) load-state-dict hooks of ``block``.

    Args:
        store: The blocks' store, which reads and writes ``block``.
        block: The block whose module gets the hooks.

    Returns:
        The hooks for ``register_load_state_dict_pre_hook`` and ``register_load_state_dict_post_hook`` of its module.
    """
    written: list[str] = []  # full keys written by the pre-hook of the load under way

    def pre(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        written.clear()
        check_adapter_shapes(module, block, state_dict, prefix)
        values, now = {}, block.names_now()
        for name, shape in zip(block.names, block.shapes):
            value = state_dict.get(prefix + now[name])
            if isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
                values[name] = value
        if not values:
            return
        read_only = block.source.read_only()
        if read_only is not None:
            raise UnsupportedError(
                f"load_state_dict: block {block.prefix} is {read_only}, which is never written: offload "
                f"without serve_from_checkpoint= to load other values"
            )
        with internal():
            write(store, block, values)
        for name in values:
            del state_dict[prefix + now[name]]
            written.append(prefix + now[name])

    def post(module, incompatible_keys) -> None:
        if written:
            done = set(written)
            incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in done]
            written.clear()

    return pre, post


def check_adapter_shapes(module: nn.Module, block: Block, state_dict: dict, prefix: str) -> None:
    """Refuse loading values of another shape into the in-memory (adapter) parameters of ``block``.

    torch would refuse too, after the load (a ``RuntimeError`` listing size mismatches); this says which parameter
    and what to do, before anything is loaded: an adapter (``PeftModel.from_pretrained``, ``load_adapter``) saved
    over another base has the other base's shapes.

    Args:
        module: The block's module.
        block: The block.
        state_dict: What is loaded.
        prefix: The module's prefix in ``state_dict``.

    Raises:
        CheckpointError: When an entry for a parameter of ``block``'s module that is not streamed has another shape.
    """
    streamed = {id(p) for p in block.params}
    for name, param in module.named_parameters():
        value = state_dict.get(prefix + name)
        if id(param) not in streamed and isinstance(value, torch.Tensor) and value.shape != param.shape:
            raise CheckpointError(
                f"load_state_dict: parameter {block.qualified(name)} (an adapter over block {block.prefix}) has "
                f"shape {tuple(param.shape)}, but the values loaded have shape {tuple(value.shape)}: an adapter "
                f"saved over another base (other sizes) cannot load onto this one. Load an adapter trained on this "
                f"base (the one its adapter_config.json names in base_model_name_or_path), or this base's own"
            )


def write(store: BlockStore, block: Block, values: dict[str, torch.Tensor]) -> None:
    """Set ``block``'s master values named in ``values`` (the others keep theirs) and store them."""
    held = store.hold_for_change(block)
    try:
        with torch.no_grad():
            for name, master in zip(block.names, block.masters):
                if name in values:
                    master.copy_(values[name])
        block.refresh_compute()
    except BaseException:
        if not held:
            store.release(block, keep_changes=False)
        raise
    if block.state is Residency.RESIDENT:
        store.write_back(block)
