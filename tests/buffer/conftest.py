"""Helpers for the wave buffer tests: a reference cache model and the strict fake driver
(synthetic clusterings: :func:`tests.fixtures.random_clusters`)."""

from __future__ import annotations

import pytest

from tests.buffer.fake_driver import StrictDriver


class RefCache:
    """Reference model of one head's cache: whole clusters, page budget, LRU, protected
    clusters of the current step never evicted, and no eviction for a cluster that cannot be
    admitted anyway."""

    def __init__(self, capacity: int, pages: list[int]):
        self.capacity, self.pages, self.order = capacity, pages, []

    def step(self, ids: list[int]) -> None:
        protected = set(ids)
        for c in ids:
            if c in self.order:
                self.order.remove(c)
                self.order.append(c)
                continue
            need = self.pages[c]
            if need == 0 or need > self.capacity:
                continue
            used = sum(self.pages[x] for x in self.order)
            evictable = sum(self.pages[x] for x in self.order if x not in protected)
            if used - evictable + need > self.capacity:
                continue  # it cannot fit even after every eviction: evict nothing for it
            while used + need > self.capacity:
                victim = next(x for x in self.order if x not in protected)
                self.order.remove(victim)
                used -= self.pages[victim]
            self.order.append(c)


@pytest.fixture
def driver():
    """A :class:`~tests.buffer.fake_driver.StrictDriver`, closed (nothing may be left
    registered, nothing unmapped while registered) when the test ends."""
    drv = StrictDriver()
    yield drv
    drv.close()
