"""Helpers for the wave buffer tests: synthetic clusterings and a reference cache model."""

from __future__ import annotations

import pytest
import torch

from tests.buffer.fake_driver import StrictDriver
from vllm_retro.index.clustering import Clusters


def random_clusters(h: int, m: int, c: int, g: torch.Generator, max_skew: float = 3.0
                    ) -> Clusters:
    """A clustering of m tokens into c clusters per head with uneven, sometimes empty sizes."""
    weights = torch.rand(h, c, generator=g) ** max_skew
    assign = torch.multinomial(weights, m, replacement=True, generator=g)  # [h, m]
    order = torch.argsort(assign, dim=1, stable=True)
    sizes = torch.stack([torch.bincount(a, minlength=c) for a in assign]).to(torch.int32)
    offsets = torch.zeros(h, c + 1, dtype=torch.int64)
    offsets[:, 1:] = sizes.long().cumsum(1)
    zeros = torch.zeros(h, c, 1)
    return Clusters(centroids=zeros, value_sums=zeros, sizes=sizes, spreads=zeros[..., 0],
                    key_sq=zeros[:, 0], cross=zeros[:, :1], order=order, offsets=offsets)


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
