"""Replacement policies of the device block cache: orders over the mapping table's arrays.

The :class:`~vllm_retro.buffer.mapping.ClusterMappingTable` is the one record of cache state:
per (KV head, cluster) whether it is cached, when it was last read (``last_access``, a stamp
that grows with every read, in read order within a step) and how often it was read while
cached (``reads``). A policy is only the order in which unprotected cached clusters leave:

- ``lru``: least recently read first;
- ``lfu`` (as in PQCache): fewest reads first, ties broken by least recent read.

The clusters read in the current step are protected and never chosen.
"""

from __future__ import annotations

import numpy as np

from vllm_retro.config import CACHE_POLICIES


def eviction_order(policy: str, last_access: np.ndarray, reads: np.ndarray,
                   candidates: np.ndarray) -> np.ndarray:
    """``candidates`` (cluster ids [n] of one head, cached and unprotected) in the order
    ``policy`` evicts them. ``last_access``, ``reads``: that head's rows of the table, [C]."""
    if policy == "lru":
        return candidates[np.argsort(last_access[candidates], kind="stable")]
    if policy == "lfu":
        return candidates[np.lexsort((last_access[candidates], reads[candidates]))]
    raise ValueError(f"cache policy {policy!r} is unknown; accepted: "
                     + ", ".join(map(repr, CACHE_POLICIES)))


def admit_greedy(need: np.ndarray, budget: int) -> np.ndarray:
    """Which of the misses (pages ``need`` [n], in read order) are admitted with ``budget``
    pages (free plus evictable): each one that still fits, in order, so a cluster too big for
    what is left is skipped and a later smaller one may still enter. Returns [n] bool."""
    cum = np.cumsum(need)
    if cum.size == 0 or cum[-1] <= budget:
        return np.ones(need.shape, dtype=bool)
    take = np.zeros(need.shape, dtype=bool)
    used = 0
    for i, n in enumerate(need.tolist()):  # only when the budget runs out: rare
        if used + n <= budget:
            take[i] = True
            used += n
    return take
