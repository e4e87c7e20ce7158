"""``ExpertCache``: experts kept in memory between forwards, by use count then recency, within a byte budget.

Expert-granular (one entry is one expert's slices of its experts module's fused parameters); the block-level resident
set (``max_resident_bytes``' pinned blocks) is separate and counted first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Key = tuple[int, int]  # (block index, expert index)


@dataclass
class ExpertStats:
    """What expert-granular reads did since the offload was made.

    Attributes:
        hits: Experts a forward chose that were in memory already (cached or prefetched).
        misses: Experts a forward chose that were read then.
        bytes_read: Storage bytes of experts read (misses and prefetches).
        prefetched: Experts read ahead by the early router.
        prefetch_used: Of those, the ones a forward then chose (before they were evicted).
        cached_bytes: Bytes of experts in memory now.
    """

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    prefetched: int = 0
    prefetch_used: int = 0
    cached_bytes: int = 0

    @property
    def prefetch_accuracy(self) -> float | None:
        """The share of prefetched experts a forward used (None before any prefetch)."""
        return self.prefetch_used / self.prefetched if self.prefetched else None


class ExpertCache:
    """One tensor list per expert, evicted least used first, then least recently used.

    Args:
        budget: Returns the bytes the cache may hold now (asked at each insertion; 0: keep nothing).
        stats: The counters to update.
    """

    def __init__(self, budget: Callable[[], int], stats: ExpertStats):
        self.budget = budget
        self.stats = stats
        self.entries: dict[Key, list[torch.Tensor]] = {}
        self.uses: dict[Key, int] = {}  # (kept after eviction: frequency across the run)
        self.last: dict[Key, int] = {}
        self.clock = 0

    def get(self, key: Key) -> list[torch.Tensor] | None:
        """The expert's tensors when in memory (counted as a use), else None."""
        self.clock += 1
        self.uses[key] = self.uses.get(key, 0) + 1
        self.last[key] = self.clock
        return self.entries.get(key)

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def put(self, key: Key, tensors: list[torch.Tensor]) -> bool:
        """Keep ``tensors`` for ``key`` if the budget allows, evicting colder experts.

        Args:
            key: The expert.
            tensors: Its slices (owned by the cache from now on).

        Returns:
            Whether it was kept.
        """
        size = sum(t.numel() * t.element_size() for t in tensors)
        limit = self.budget()
        if size > limit:
            return False
        rank = lambda k: (self.uses.get(k, 0), self.last.get(k, 0))  # noqa: E731
        while self.stats.cached_bytes + size > limit:
            coldest = min(self.entries, key=rank)
            if rank(coldest) > rank(key):
                return False  # everything kept is hotter than this one
            self.drop(coldest)
        self.entries[key] = tensors
        self.stats.cached_bytes += size
        return True

    def drop(self, key: Key) -> None:
        """Forget ``key``'s tensors."""
        tensors = self.entries.pop(key)
        self.stats.cached_bytes -= sum(t.numel() * t.element_size() for t in tensors)

    def clear(self) -> None:
        """Forget every expert (their weights may have changed)."""
        for key in list(self.entries):
            self.drop(key)
