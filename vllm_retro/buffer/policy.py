"""Replacement policies of the device block cache, behind one interface.

A policy orders the cached clusters of one (request, layer, KV head) and names the next
victim; the block cache does the bookkeeping of blocks. ``protected`` clusters (those read in
the current step) are never chosen as victims.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Container


class CachePolicy(ABC):
    """Orders cached cluster ids; ``victim`` names the next one to evict."""

    @abstractmethod
    def hit(self, key: int) -> None:
        """A cached cluster was read."""

    @abstractmethod
    def admitted(self, key: int) -> None:
        """A cluster entered the cache (it was just read)."""

    @abstractmethod
    def evicted(self, key: int) -> None:
        """A cluster left the cache."""

    @abstractmethod
    def victim(self, protected: Container[int]) -> int | None:
        """The cluster to evict next, never one in ``protected``; None if there is none."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of cached clusters tracked."""


class LRUPolicy(CachePolicy):
    """Least recently used: evict the cluster read longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def hit(self, key: int) -> None:
        self._order.move_to_end(key)

    def admitted(self, key: int) -> None:
        self._order[key] = None

    def evicted(self, key: int) -> None:
        del self._order[key]

    def victim(self, protected: Container[int]) -> int | None:
        return next((k for k in self._order if k not in protected), None)

    def __len__(self) -> int:
        return len(self._order)


class LFUPolicy(CachePolicy):
    """Least frequently used (as in PQCache), ties broken by least recent use. Frequencies
    count reads while cached, starting at 1 on admission."""

    def __init__(self) -> None:
        self._freq: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._tick = 0

    def _touch(self, key: int, freq: int) -> None:
        self._tick += 1
        self._freq[key] = freq
        self._last[key] = self._tick

    def hit(self, key: int) -> None:
        self._touch(key, self._freq[key] + 1)

    def admitted(self, key: int) -> None:
        self._touch(key, 1)

    def evicted(self, key: int) -> None:
        del self._freq[key], self._last[key]

    def victim(self, protected: Container[int]) -> int | None:
        candidates = [k for k in self._freq if k not in protected]
        if not candidates:
            return None
        return min(candidates, key=lambda k: (self._freq[k], self._last[k]))

    def __len__(self) -> int:
        return len(self._freq)


POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> CachePolicy:
    """A fresh policy by name ('lru' or 'lfu')."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"cache policy {name!r} is unknown; accepted: "
                         + ", ".join(map(repr, POLICIES))) from None
