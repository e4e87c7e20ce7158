"""The registry of block adapters, and the two questions the rest of the package asks it.

A ``BlockAdapter`` answers, for one kind of module, which of its children are blocks (``children``) and, for one kind
of block, which parameters it streams (``parameters``); ``None`` means "not mine": the next adapter is asked. The
registry is ordered newest first, and ends with the default ``SEQUENCES`` adapter, which cannot be removed.
"""

from __future__ import annotations

from torch import nn

from .protocol import BlockAdapter, Child
from .sequences import SEQUENCES

_ADAPTERS: list[BlockAdapter] = []


def register_adapter(adapter: BlockAdapter) -> None:
    """Register ``adapter``, consulted before every adapter registered earlier (and before the default one).

    Args:
        adapter: The adapter (any object with ``name``, ``children`` and ``parameters``).

    Raises:
        ValueError: When an adapter of that name is registered already.
    """
    if any(a.name == adapter.name for a in adapters()):
        raise ValueError(f"a block adapter named {adapter.name!r} is registered already; unregister_adapter() it first")
    _ADAPTERS.insert(0, adapter)


def unregister_adapter(name: str) -> None:
    """Remove the adapter registered under ``name``.

    Args:
        name: The adapter's name.

    Raises:
        KeyError: When no adapter of that name was registered (the default one cannot be removed).
    """
    for i, adapter in enumerate(_ADAPTERS):
        if adapter.name == name:
            del _ADAPTERS[i]
            return
    raise KeyError(f"no block adapter named {name!r} is registered (registered: {[a.name for a in _ADAPTERS]})")


def adapters() -> list[BlockAdapter]:
    """The adapters in the order they are asked: newest first, the default ``sequences`` last.

    Returns:
        A new list.
    """
    return [*_ADAPTERS, SEQUENCES]


def children(module: nn.Module) -> list[Child]:
    """The first answer of the adapters about ``module``'s children; a module none knows: look inside every child."""
    for adapter in adapters():
        found = adapter.children(module)
        if found is not None:
            return found
    return [Child(name, child, False) for name, child in module.named_children()]


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of ``module`` as the registered adapters find them (see ``deepoffload.find_blocks``).

    Args:
        module: The model to look through.

    Returns:
        The blocks as (qualified name, submodule), in the order found; blocks without parameters are left out.
    """

    def walk(node: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
        found = []
        for name, child, block in children(node):
            qualified = f"{prefix}{name}"
            if not block:
                found.extend(walk(child, qualified + "."))
            elif any(True for _ in child.parameters()):
                found.append((qualified, child))
        return found

    return walk(module, "")


def streamed_parameters(block: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``block`` streams, by the first adapter that knows it (the default: all of them).

    Args:
        block: The block being set up.

    Returns:
        (name relative to the block, parameter), in the order they are stored.

    Raises:
        ValueError: When the adapter's answer is not the block's parameters, each once.
    """
    adapter, named = next((a, n) for a in adapters() if (n := a.parameters(block)) is not None)  # the last answers
    own = {id(p): n for n, p in block.named_parameters()}
    if sorted(id(p) for _, p in named) != sorted(own) or any(own[id(p)] != n for n, p in named):
        raise ValueError(
            f"block adapter {adapter.name!r}: parameters() of a {type(block).__name__} must name each of the "
            f"block's parameters once, as named_parameters() names them"
        )
    return named
