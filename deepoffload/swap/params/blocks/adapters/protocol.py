"""What a block adapter is: the ``BlockAdapter`` protocol and the ``Child`` it answers with."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from torch import nn


class Child(NamedTuple):
    """One child of a module, as an adapter sees it.

    Attributes:
        name: Its name in its parent (as in ``named_children``).
        module: The child.
        block: True: the child is a block (streamed whole; not looked inside); False: look inside it.
    """

    name: str
    module: nn.Module
    block: bool


class BlockAdapter(Protocol):
    """How one kind of model keeps its blocks and what one kind of block is made of."""

    name: str
    """A unique name, used by ``unregister_adapter``."""

    def children(self, module: nn.Module) -> list[Child] | None:
        """The children of ``module`` in the order they run, each marked block or not; None: not a module it knows."""
        ...

    def parameters(self, block: nn.Module) -> list[tuple[str, nn.Parameter]] | None:
        """The parameters ``block`` streams, by name relative to it, in storage order; None: not a block it knows."""
        ...
