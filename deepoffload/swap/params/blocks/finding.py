"""Which submodules are blocks: the registered block adapters decide (``adapters``)."""

from __future__ import annotations

from torch import nn

from . import adapters


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of ``module``: by default the children of every ``nn.ModuleList`` / ``nn.Sequential`` in it.

    The module is walked from the top (the module itself included), not looking inside a block once chosen; children
    without parameters are skipped. Each module met is asked of the registered block adapters, newest first
    (``deepoffload.swap.params.blocks.adapters.register_adapter``): the first that knows it says which children are
    blocks, in the order they run.

    Args:
        module: The model to look through.

    Returns:
        The blocks as (qualified name, submodule), in the order they were found.

    Examples:
        >>> import deepoffload
        >>> from torch import nn
        >>> class Model(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = nn.Embedding(10, 4)
        ...         self.layers = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)])
        >>> [name for name, block in deepoffload.find_blocks(Model())]  # the ReLU has no parameters
        ['layers.0', 'layers.2']
    """
    return adapters.find_blocks(module)
