"""The default block adapter: the children of every ``nn.ModuleList`` and ``nn.Sequential`` are blocks.

A child of such a container that is itself an ``nn.ModuleList`` is looked inside (a list of lists of layers); a block
streams all its parameters, in ``named_parameters`` order.
"""

from __future__ import annotations

from torch import nn

from .protocol import Child


class Sequences:
    """Blocks are the children of ``nn.ModuleList`` / ``nn.Sequential`` containers."""

    name = "sequences"
    description = "the children of nn.ModuleList and nn.Sequential containers (always asked last)"

    def children(self, module: nn.Module) -> list[Child] | None:
        """The container's children, each a block unless it is an ``nn.ModuleList``; None for other modules."""
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            return None
        return [Child(n, c, not isinstance(c, nn.ModuleList)) for n, c in module.named_children()]

    def parameters(self, block: nn.Module) -> list[tuple[str, nn.Parameter]] | None:
        """Every parameter of ``block``, in ``named_parameters`` order."""
        return list(block.named_parameters())


SEQUENCES = Sequences()
