"""``Chunk``: parameters an ``OffloadedOptimizer`` steps together, with what each step needs of them worked out once."""

from __future__ import annotations

from typing import Iterable

import torch


class Chunk(list):
    """Parameters stepped together, with what each step needs of them worked out once.

    That is their group names (``names``, ``by_name``) and, per param group, the chunk's parameters in it
    (``in_groups``).
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        super().__init__(params)
        self.names: list[str] = []
        self.by_name: dict[str, torch.Tensor] = {}
        self.in_groups: list[list[torch.Tensor]] | None = None
