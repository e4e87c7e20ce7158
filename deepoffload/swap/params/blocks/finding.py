"""Which submodules are blocks by default."""

from __future__ import annotations

from torch import nn


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The default blocks of ``module``: the children of every ``nn.ModuleList`` / ``nn.Sequential`` in it.

    The module is walked from the top (the module itself included), not looking inside a block once chosen; children
    without parameters are skipped.

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

    def walk(node: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
        found = []
        container = isinstance(node, (nn.ModuleList, nn.Sequential))
        for name, child in node.named_children():
            qualified = f"{prefix}{name}"
            if container and not isinstance(child, nn.ModuleList):
                if any(True for _ in child.parameters()):
                    found.append((qualified, child))
            else:
                found.extend(walk(child, qualified + "."))
        return found

    return walk(module, "")
