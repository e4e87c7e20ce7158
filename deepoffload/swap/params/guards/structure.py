"""The parameters a streamed model was offloaded with, checked again as blocks run.

A parameter added, replaced or removed afterwards (``resize_token_embeddings``, ``get_peft_model``, ``add_module``, a
replaced ``nn.Linear``) would be in no optimizer (never stepped, its gradient piling up) or, inside a block, outside the
streamed set; such a change is refused at the next forward, naming it and the order that works. (A parameter unfrozen
after offloading is refused at backward: see ``training.optimizers.Optimizers.check_unfrozen``.)

One change is taken instead of refused: adapter layers (PEFT's LoRA, ``get_peft_model`` or
``PeftModel.from_pretrained`` after offloading) that wrap modules inside the blocks. Each streamed parameter is still
there (under a new name, the same tensor: ``q_proj.weight`` -> ``q_proj.base_layer.weight``), and the parameters
added are new in-memory tensors: ``adapter_layers`` names them, and the ``ParameterOffload`` keeps them in memory and
steps them with the parameters outside the blocks, while the blocks stream as before (served ones from the
checkpoint, never written). An adapter on a parameter outside the blocks is refused, naming it.
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from ....errors import UnsupportedError
from ..blocks.placeholders import StreamedParameter
from ..blocks.residency import Block

ORDER = (
    "make such changes (resize_token_embeddings, get_peft_model, add_module, replacing modules) before "
    "offload_parameters(), or close() the offload, change the model and offload it again"
)


def _identities(named) -> dict[str, int]:
    return {name: id(param) for name, param in named}


class Structure:
    """The names and identities of ``module``'s parameters at offloading, inside each block and outside them."""

    def __init__(self, module: nn.Module, blocks: Sequence[Block]):
        self.module = module
        self.prefixes = tuple(b.prefix + "." for b in blocks if b.prefix)
        self.whole = any(not b.prefix for b in blocks)  # the module itself is a block
        self.rest = self._rest()
        self.blocks = {b.index: _identities(b.module.named_parameters(remove_duplicate=False)) for b in blocks}
        self._modules = {b.index: (b.module, b.prefix) for b in blocks}

    def _rest(self) -> dict[str, int]:
        if self.whole:
            return {}
        return _identities(
            (n, p) for n, p in self.module.named_parameters(remove_duplicate=False) if not n.startswith(self.prefixes)
        )

    def adapter_layers(self) -> list[tuple[str, nn.Parameter]] | None:
        """The parameters added inside the blocks since offloading when the change is adapter layers, else None.

        Adapter layers: every streamed parameter of every block is still in its block (the same tensor, possibly
        under a new name), the parameters outside the blocks are unchanged, and each parameter added is a new
        in-memory tensor (not another block's, not on the ``meta`` device) inside a module that now wraps a
        streamed parameter moved under it (PEFT's ``q_proj`` around ``q_proj.base_layer.weight``).

        Returns:
            The added parameters by qualified name (in the model's order); None when the change is anything else
            (``check`` then names it).
        """
        streamed = {identity for identities in self.blocks.values() for identity in identities.values()}
        added: list[tuple[str, nn.Parameter]] = []
        for index, then in self.blocks.items():
            module, prefix = self._modules[index]
            now = module.named_parameters(remove_duplicate=False)
            named = [(f"{prefix}.{n}" if prefix else n, p) for n, p in now]
            if not set(then.values()) <= {id(p) for _, p in named}:
                return None  # a streamed parameter was replaced or removed
            # a wrapper: the module around a streamed parameter now under another name (q_proj around base_layer)
            old = {identity: f"{prefix}.{name}" if prefix else name for name, identity in then.items()}
            moved = [n for n, p in named if old.get(id(p), n) != n]
            wrappers = tuple(n.rsplit(".", 2)[0] + "." for n in moved if n.count(".") >= 2)
            for name, param in named:
                if id(param) in streamed:
                    continue
                beside = name.startswith(wrappers) if wrappers else False
                if not beside or isinstance(param, StreamedParameter) or param.device.type == "meta":
                    return None
                added.append((name, param))
        if self._rest() != self.rest:
            return None
        return added

    def adopt(self, take: Callable[[list[tuple[str, nn.Parameter]]], None], block: Block | None = None) -> None:
        """Hand the parameters of adapter layers added since offloading to ``take``, then record the blocks anew.

        Args:
            take: Called with the added parameters by qualified name (see ``adapter_layers``), when there are any.
            block: The block about to run: when its parameters are those recorded, nothing is looked at (the
                blocks are wrapped all at once, and a forward runs the first block first); None: look at every block.
        """
        if (
            block is not None
            and _identities(block.module.named_parameters(remove_duplicate=False)) == self.blocks[block.index]
        ):
            return
        added = self.adapter_layers()
        if not added:
            return
        take(added)
        self.blocks = {
            index: _identities(module.named_parameters(remove_duplicate=False))
            for index, (module, _) in self._modules.items()
        }

    def check(self, block: Block, rest: bool) -> None:
        """Raise if ``block``'s parameters (and with ``rest`` those outside the blocks) differ from those at offloading.

        Args:
            block: The block about to run.
            rest: Whether to check the parameters outside the blocks too.

        Raises:
            UnsupportedError: When a parameter was added, replaced, moved or removed since offloading (named).
        """
        now = _identities(block.module.named_parameters(remove_duplicate=False))
        outside = _moved_outside(self.rest, self._rest()) if rest or now != self.blocks[block.index] else None
        if outside:
            raise UnsupportedError(
                f"parameter {outside[0]} is outside the streamed blocks and was wrapped by an adapter layer after "
                f"offload_parameters() (PEFT: it is now {outside[1]}): adapters are taken only on modules inside "
                f"the blocks, whose base streams while the adapters stay in memory. Leave it out of the adapter's "
                f"target_modules (e.g. target_modules=['q_proj', 'v_proj'] names modules inside the blocks), or "
                f"make such changes before offload_parameters()"
            )
        if now != self.blocks[block.index]:
            raise UnsupportedError(
                f"block {block.prefix}: {_difference(self.blocks[block.index], now, block.prefix)} "
                f"after offload_parameters(), so it would not be streamed or stepped with the block "
                f"(a silently untrained or lost parameter): {ORDER}"
            )
        if rest:
            now = self._rest()
            if now != self.rest:
                raise UnsupportedError(
                    f"{_difference(self.rest, now, '')} after offload_parameters(), so no optimizer "
                    f"made there would step it (its gradient would pile up, untrained): {ORDER}"
                )


def _moved_outside(then: dict[str, int], now: dict[str, int]) -> tuple[str, str] | None:
    """(old name, new name) of a parameter outside the blocks now under another name (wrapped), or None."""
    names = {identity: name for name, identity in now.items()}
    for name, identity in then.items():
        if name not in now and identity in names:
            return name, names[identity]
    return None


def _difference(then: dict[str, int], now: dict[str, int], prefix: str) -> str:
    def full(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    added = [n for n in now if n not in then]
    removed = [n for n in then if n not in now]
    replaced = [n for n in now if n in then and now[n] != then[n]]
    # a parameter under a new name (wrapped: peft's base_layer) is the same tensor, moved
    old_names = {identity: n for n, identity in then.items() if n in removed}
    moved = [n for n in added if now[n] in old_names]
    added = [n for n in added if n not in moved]
    removed = [n for n in removed if then[n] not in {now[m] for m in moved}]
    parts = (
        [
            f"parameter {full(old_names[now[moved[0]]])} was moved to {full(moved[0])}"
            + (f" ({len(moved) - 1} more moved)" if len(moved) > 1 else "")
        ]
        if moved
        else []
    )
    for names, what in ((replaced, "replaced"), (added, "added"), (removed, "removed")):
        if names:
            shown = ", ".join(full(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            parts.append(
                f"parameter{'s' if len(names) > 1 else ''} {shown} {'were' if len(names) > 1 else 'was'} {what}"
            )
    return "; ".join(parts)
