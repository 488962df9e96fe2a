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


def victims(policy: str, last_access: np.ndarray, reads: np.ndarray, heads: np.ndarray,
            clusters: np.ndarray, pages: np.ndarray, deficit: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """The clusters ``policy`` evicts to free ``deficit[h]`` pages in every head h at once
    (no loop over heads).

    ``last_access``, ``reads``: the table's [H, C] int64 arrays; ``heads``, ``clusters``,
    ``pages``: the evictable clusters (cached, not read this step) as [n] int64 lists and
    their page counts; ``deficit``: [H] pages to free (<= 0: none). Each head's evictable
    clusters are ordered by the policy (ties by cluster id) and taken while the pages freed
    before each are short of its deficit. Returns (head, cluster) [k] int64 each, grouped
    by head and in eviction order within a head."""
    if policy not in CACHE_POLICIES:
        raise ValueError(f"cache policy {policy!r} is unknown; accepted: "
                         + ", ".join(map(repr, CACHE_POLICIES)))
    keep = deficit[heads] > 0
    heads, clusters, pages = heads[keep], clusters[keep], pages[keep]
    if heads.size == 0:
        return heads, clusters
    la = last_access[heads, clusters]
    if policy == "lru":
        order = _lru_order(heads, la, clusters, last_access.shape)
    else:  # lfu
        order = np.lexsort((clusters, la, reads[heads, clusters], heads))
    heads, clusters, pages = heads[order], clusters[order], pages[order]
    before = np.cumsum(pages) - pages  # pages freed before each, from the first head on
    first = np.searchsorted(heads, heads, side="left")  # each head's first entry
    take = before - before[first] < deficit[heads]
    return heads[take], clusters[take]


def _lru_order(heads: np.ndarray, la: np.ndarray, clusters: np.ndarray,
               shape: tuple[int, ...]) -> np.ndarray:
    """The order of (head, last access, cluster id), ascending: one argsort of a packed
    int64 key when the three fit in 63 bits (always, short of ~10^11 reads per store),
    else a lexsort (4x slower)."""
    cb = max(int(shape[1]) - 1, 1).bit_length()
    lb = max(int(la.max()), 1).bit_length()
    if max(int(shape[0]) - 1, 1).bit_length() + lb + cb > 63:
        return np.lexsort((clusters, la, heads))  # the last key sorts first
    return np.argsort((heads << (lb + cb)) | (la << cb) | clusters)


def eviction_order(policy: str, last_access: np.ndarray, reads: np.ndarray,
                   candidates: np.ndarray) -> np.ndarray:
    """``candidates`` (cluster ids [n] of one head, cached and unprotected) in the order
    ``policy`` evicts them. ``last_access``, ``reads``: that head's rows of the table, [C]."""
    cand = np.asarray(candidates, dtype=np.int64)
    ones = np.ones(cand.shape, dtype=np.int64)
    _, order = victims(policy, last_access[None], reads[None], 0 * ones, cand, ones,
                       np.array([cand.size + 1]))
    return order


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
