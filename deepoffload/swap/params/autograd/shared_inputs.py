"""Tensors passed to several blocks in one forward, and the order their gradients are summed in.

T5's encoder output reaches the cross-attention of every decoder block, and the decoder's position bias (made by its
first block) every later block. In memory the autograd engine adds each use's gradient into one buffer, one use at a
time, latest use first: ``((g_n_v + g_n_k) + g_n-1_v) + g_n-1_k ...``. A streamed block is one autograd node that
returns one gradient per input, already summed over its own uses, so the engine would add per-block sums
``(g_n_v + g_n_k) + (g_n-1_v + g_n-1_k)``: another association, another rounding (amplified by bf16 and Adam's
normalised steps up to 3e-2 in a few steps).

So a tensor passed to a block is passed on: the block's node also returns it (an alias), and the next block given the
same tensor object in the same forward gets that alias instead. In backward the later block's gradient for the
tensor, everything summed so far, reaches the earlier block through the alias, and the earlier block's recompute adds
it first and then its own uses in the engine's order (``Recompute.backward``): the same sums, in the same order, as
in memory.
"""

from __future__ import annotations

import torch


def differentiable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` requires a gradient and can have one (floating point or complex)."""
    return tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex())


class SharedInputs:
    """The latest alias of each tensor passed to a block in the forward under way (see the module's docstring)."""

    def __init__(self) -> None:
        # id(tensor) -> (tensor, its version then, its alias)
        self._latest: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._last_index = -1

    def substitute(self, index: int, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """The tensors block ``index`` is to get, and the positions among them to pass on.

        A forward is a run of calls with rising block indices; a call made inside a backward
        (``torch.utils.checkpoint``'s recomputation) belongs to no forward and chains nothing.

        Args:
            index: The block being called.
            tensors: The tensors among its arguments.

        Returns:
            ``tensors`` with those an earlier block of this forward got replaced by its alias, and the positions of
            the differentiable ones among them (to pass on).
        """
        if torch._C._current_graph_task_id() != -1:
            return tensors, []
        if index <= self._last_index:  # a new forward (or a block called twice in one): start again
            self._latest.clear()
        self._last_index = index
        given = []
        for tensor in tensors:
            entry = self._latest.get(id(tensor))
            # changed in place since (its version moved): its graph now runs through that change, the alias's not
            if entry is not None and entry[0] is tensor and entry[1] == tensor._version:
                given.append(entry[2])
            else:
                given.append(tensor)
        return given, [k for k, tensor in enumerate(given) if differentiable(tensor)]

    def record(self, originals: list[torch.Tensor], chained: list[int], aliases: tuple[torch.Tensor, ...]) -> None:
        """The block passed ``originals[k]`` on as ``aliases[j]`` for ``k = chained[j]``."""
        for k, alias in zip(chained, aliases):
            self._latest[id(originals[k])] = (originals[k], originals[k]._version, alias)

    def clear(self) -> None:
        """Forget the forward (a backward started: nothing is held past it)."""
        self._latest.clear()
        self._last_index = -1
