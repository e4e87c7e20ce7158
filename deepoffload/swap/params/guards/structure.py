"""The parameters a streamed model was offloaded with, checked again as blocks run.

A parameter added, replaced or removed afterwards (``resize_token_embeddings``, ``get_peft_model``, ``add_module``, a
replaced ``nn.Linear``) would be in no optimizer (never stepped, its gradient piling up) or, inside a block, outside the
streamed set; such a change is refused at the next forward, naming it and the order that works. (A parameter unfrozen
after offloading is refused at backward: see ``training.optimizers.Optimizers.check_unfrozen``.)
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ....errors import UnsupportedError
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

    def _rest(self) -> dict[str, int]:
        if self.whole:
            return {}
        return _identities(
            (n, p) for n, p in self.module.named_parameters(remove_duplicate=False) if not n.startswith(self.prefixes)
        )

    def check(self, block: Block, rest: bool) -> None:
        """Raise if ``block``'s parameters (and with ``rest`` those outside the blocks) differ from those at offloading.

        Args:
            block: The block about to run.
            rest: Whether to check the parameters outside the blocks too.

        Raises:
            UnsupportedError: When a parameter was added, replaced, moved or removed since offloading (named).
        """
        now = _identities(block.module.named_parameters(remove_duplicate=False))
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
