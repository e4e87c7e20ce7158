"""Which submodules are blocks by default."""

from __future__ import annotations

from torch import nn


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The default blocks of ``module`` as (qualified name, submodule): the children of every ``nn.ModuleList`` /
    ``nn.Sequential`` found by walking the module from the top (the module itself included), not looking inside a
    block once chosen; children without parameters are skipped.
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
