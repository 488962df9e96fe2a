"""The cluster mapping table of one (request, layer): where every cluster's pages are.

An array per field, indexed by (KV head, cluster id): the cluster's first page in the
layer's host pool and page count, its size in tokens, whether it is cached on the device,
when it was last read (the LRU position) and how often it was read while cached (the LFU
count). These arrays and the host pool's page-indexed ``page_block`` (each page's device
block, -1 when not cached; :class:`~vllm_retro.buffer.host_tier.HostTier`) are the one
record of cache state; the replacement policies only order them
(:mod:`vllm_retro.buffer.policy`). A cached cluster has all its pages mapped. Lookups only
read; the update worker is the only writer, and the store never lets a lookup overlap its
own pending update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from vllm_retro.kernels.gather import HIT, MISS


def runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], starts[i] + counts[i])`` over i ([n] int arrays)."""
    counts = counts.astype(np.int64)
    begin = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - begin, counts)


def token_runs(kind: np.ndarray, src_row: np.ndarray, row0: int, col0: int, t_cap: int
               ) -> np.ndarray:
    """The gather plan's runs (:mod:`vllm_retro.kernels.gather`, [N, 3] int64) of per-token
    places ``kind``/``src_row`` ([H, T]: 0 padding, HIT device-pool row, MISS host-pool row)
    whose head h goes to execution-buffer row ``row0 + h`` ([rows, t_cap]) from slot
    ``col0``: one run per maximal stretch of a head's consecutive slots with consecutive
    source rows in one pool (as the compiled lookup writes them)."""
    hh, tt = np.nonzero(kind)
    k, s = kind[hh, tt], src_row[hh, tt]
    start = np.ones(hh.size, dtype=bool)
    start[1:] = ((hh[1:] != hh[:-1]) | (tt[1:] != tt[:-1] + 1) | (k[1:] != k[:-1])
                 | (s[1:] != s[:-1] + 1))
    first = np.flatnonzero(start)
    length = np.diff(np.append(first, hh.size))
    out = np.empty((first.size, 3), dtype=np.int64)
    out[:, 0] = (row0 + hh[first]) * t_cap + col0 + tt[first]
    out[:, 1] = s[first]
    out[:, 2] = np.where(k[first] == HIT, length, -length)
    return out


@dataclass(frozen=True)
class Lookup:
    """Where the tokens of one step's retrieval clusters come from: per token (numpy
    lookups) or as runs in a layer's gather plan (the compiled lookup)."""

    totals: np.ndarray
    """[H] int64 tokens per head."""
    cached: np.ndarray
    """[H, R] bool: the cluster was a cache hit."""
    begins: np.ndarray
    """[H, R] int64 first slot of each cluster within the head's retrieved tokens."""
    kind: np.ndarray | None = None
    """[H, T] int32 per token slot: 0 padding, 1 device cache, 2 host tier (numpy
    lookups)."""
    src_row: np.ndarray | None = None
    """[H, T] int64 row in the device pool (hits) or the host pool (misses) (numpy
    lookups)."""
    host_row: np.ndarray | None = None
    """[H, T] int64 host row of every slot (-1 padding), e.g. for its token position (numpy
    lookups)."""
    counts: np.ndarray | None = None
    """[4] int64 (hit tokens, miss tokens, cached clusters, host pages of the clusters not
    cached): set by cluster lookups, None for token reads."""
    runs: np.ndarray | None = None
    """[N, 3] int64: this lookup's runs in the gather plan it was written into (a view,
    valid until the plan is reused; the compiled lookup)."""

    def plan(self, row0: int, col0: int, t_cap: int) -> np.ndarray:
        """This lookup's gather-plan runs ([N, 3] int64) for execution-buffer rows ``row0
        ..`` ([rows, t_cap]) from slot ``col0``: see :func:`token_runs`."""
        if self.kind is None or self.src_row is None:
            if self.runs is None:
                raise ValueError("this lookup has neither per-token places nor runs")
            return self.runs
        return token_runs(self.kind, self.src_row, row0, col0, t_cap)

    def write_into(self, plan: np.ndarray, at: int, row0: int, col0: int, t_cap: int
                   ) -> Lookup:
        """Write :meth:`plan`'s runs into a layer's gather plan ``plan`` ([N, 3] int64) from
        entry ``at``, as the compiled lookup does (same checks); returns this lookup with
        ``runs`` the view of them."""
        need = col0 + (int(self.totals.max()) if self.totals.size else 0)
        if need > t_cap:
            raise RuntimeError(f"buffer: the execution buffer has {t_cap} slots, the step's "
                               f"tokens need {need}")
        runs = self.plan(row0, col0, t_cap)
        if at + len(runs) > len(plan):
            raise RuntimeError(f"buffer: the gather plan has room for {len(plan)} runs")
        plan[at:at + len(runs)] = runs
        return replace(self, runs=plan[at:at + len(runs)])


RECORD_FIELDS = ("page_start", "n_pages", "size", "last_access", "reads")
"""The int64 fields of a cluster's record, in order (kernels/csrc/buffer_cpu.cpp reads
them by these positions)."""
RECORD_WIDTH = 8
"""int64 slots per record (the fields, then padding): one 64-byte cache line per
cluster."""


def _record_field(name: str, what: str) -> property:
    """The [H, C] int64 view of field ``name`` of :attr:`ClusterMappingTable.records`."""
    i = RECORD_FIELDS.index(name)
    return property(lambda self: self.records[..., i], doc=f"[H, C] int64 view: {what}.")


class ClusterMappingTable:
    """Cluster descriptors of one request's layer.

    The int64 fields are one record per (KV head, cluster) in :attr:`records` ([H, C, 8]),
    so a step that touches a cluster reads one cache line rather than one per field (the
    step's clusters are scattered over tables of up to ~0.5 MB per field at 128K tokens);
    :attr:`page_start` and the other fields are [H, C] views of it. :attr:`cached` is a
    separate [H, C] bool array (numpy masks by it)."""

    def __init__(self, num_heads: int, page_size: int):
        self.page_size = page_size
        self.records = np.zeros((num_heads, 0, RECORD_WIDTH), dtype=np.int64)
        """[H, C, 8] int64: per cluster its :data:`RECORD_FIELDS`, then padding."""
        self.cached = np.zeros((num_heads, 0), dtype=bool)

    page_start = _record_field("page_start", "first host page of each cluster")
    n_pages = _record_field("n_pages", "host pages of each cluster")
    size = _record_field("size", "tokens of each cluster")
    last_access = _record_field("last_access",
                                "the recency stamp of each cluster's last read (0: never)")
    reads = _record_field("reads", "reads of each cluster while cached (0: not cached)")

    @property
    def num_clusters(self) -> int:
        """Clusters per head."""
        return int(self.records.shape[1])

    def add_clusters(self, page_start: np.ndarray, n_pages: np.ndarray, size: np.ndarray
                     ) -> None:
        """Append clusters ([H, c] arrays: first host page, pages, tokens). The records and
        the cached flags are replaced by new arrays (a reader holding the old ones keeps
        valid descriptors of the clusters before)."""
        h, c = size.shape
        new = np.zeros((h, c, RECORD_WIDTH), dtype=np.int64)
        for name, value in (("page_start", page_start), ("n_pages", n_pages), ("size", size)):
            new[..., RECORD_FIELDS.index(name)] = value
        self.records = np.concatenate([self.records, new], axis=1)
        self.cached = np.concatenate([self.cached, np.zeros((h, c), dtype=bool)], axis=1)

    def cached_pages(self) -> np.ndarray:
        """Device blocks each head's cached clusters hold ([H] int64)."""
        flat = np.flatnonzero(self.cached)  # far faster than a masked sum over [H, C]
        held = np.bincount(flat // max(self.num_clusters, 1),
                           weights=self.n_pages.reshape(-1)[flat], minlength=self.size.shape[0])
        return held.astype(np.int64)

    def pages_of(self, head: int, cluster: int) -> slice:
        """The cluster's host pages."""
        start = int(self.page_start[head, cluster])
        return slice(start, start + int(self.n_pages[head, cluster]))

    def lookup(self, cluster_ids: np.ndarray, page_block: np.ndarray) -> Lookup:
        """Locate every token of ``cluster_ids`` ([H, R] int64; read-only); ``page_block``:
        the host pool's page -> device block map. Numpy only: the table lives on the host,
        and this runs per request and layer step."""
        c = self.num_clusters
        if cluster_ids.size and (cluster_ids.min() < 0 or cluster_ids.max() >= c):
            bad = cluster_ids[(cluster_ids < 0) | (cluster_ids >= c)][0]
            raise ValueError(f"cluster id {int(bad)} is out of range; accepted: 0 to {c - 1}")
        h, r = cluster_ids.shape
        rows = np.arange(h)[:, None]
        sizes = self.size[rows, cluster_ids]  # [H, R]
        totals = sizes.sum(axis=1)
        t = int(totals.max()) if h and r else 0
        # every head's tokens, concatenated head after head, and their (head, slot) places
        flat = runs(self.page_start[rows, cluster_ids].reshape(-1) * self.page_size,
                    sizes.reshape(-1))
        head = np.repeat(np.arange(h), totals)
        slot = np.arange(flat.size) - np.repeat(np.cumsum(totals) - totals, totals)
        host_row = np.full((h, t), -1, dtype=np.int64)
        host_row[head, slot] = flat
        block = np.full((h, t), -1, dtype=np.int64)
        block[head, slot] = page_block[flat // self.page_size]
        hit = block >= 0
        kind = np.where(hit, HIT, np.where(host_row >= 0, MISS, 0)).astype(np.int32)
        src_row = np.where(hit, block * self.page_size + host_row % self.page_size,
                           np.maximum(host_row, 0))
        begins = np.cumsum(sizes, axis=1) - sizes
        cached = np.take_along_axis(self.cached, cluster_ids, axis=1)
        pages = np.take_along_axis(self.n_pages, cluster_ids, axis=1)[~cached].sum()
        counts = np.array([(kind == HIT).sum(), (kind == MISS).sum(), cached.sum(), pages],
                          dtype=np.int64)
        return Lookup(totals, cached, begins, kind, src_row, host_row, counts)

    def lookup_into(self, module: Any, cluster_ids: np.ndarray, page_block: np.ndarray,
                    plan: np.ndarray, at: int, row0: int, col0: int, t_cap: int) -> Lookup:
        """:meth:`lookup` by the compiled extension ``module`` (``buffer_lookup``, without
        the GIL), written straight into a layer's gather plan ``plan`` ([N, 3] int64 runs,
        :mod:`vllm_retro.kernels.gather`) from entry ``at``: this table's head h goes to
        execution-buffer row ``row0 + h`` ([rows, t_cap]) from slot ``col0``. The runs are
        those :func:`token_runs` makes of :meth:`lookup`'s places; the Lookup's ``runs`` is
        a view of them, its per-token fields None and its ``counts`` set."""
        cached, begins, totals, counts, n = module.buffer_lookup(
            torch.from_numpy(cluster_ids), torch.from_numpy(self.records),
            torch.from_numpy(self.cached), torch.from_numpy(page_block), self.page_size,
            torch.from_numpy(plan), at, row0, col0, t_cap)
        return Lookup(totals.numpy(), cached.numpy(), begins.numpy(), counts=counts.numpy(),
                      runs=plan[at:at + n])

    @staticmethod
    def lookup_batch_into(module: Any, tables: Sequence[ClusterMappingTable],
                          cluster_ids: Sequence[np.ndarray], page_block: np.ndarray,
                          plan: np.ndarray, col0: Sequence[int], t_cap: int,
                          threads: int = 1) -> list[Lookup]:
        """:meth:`lookup_into` for every store of a layer's step in one compiled call
        (``buffer_lookup_batch``: the stores in parallel on ``threads`` OpenMP threads,
        without the GIL). Table j looks ``cluster_ids[j]`` ([H, R_j] int64; every table has
        H heads) up, its head h going to execution-buffer row ``j * H + h`` ([rows, t_cap])
        from slot ``col0[j]``; ``page_block`` is the host pool they all live in; ``plan``
        ([>= len(tables) * H * t_cap, 3] int64: each table's runs are written into a region
        of its own first) ends up holding every table's runs from entry 0, table after
        table. The Lookups are those :meth:`lookup_into` returns, one per table."""
        if not tables:
            return []
        cached, begins, totals, counts, n_runs = module.buffer_lookup_batch(
            [torch.from_numpy(i) for i in cluster_ids],
            [torch.from_numpy(t.records) for t in tables],
            [torch.from_numpy(t.cached) for t in tables], torch.from_numpy(page_block),
            tables[0].page_size, torch.from_numpy(plan), list(col0), t_cap, threads)
        cached, begins, totals, counts = (x.numpy() for x in (cached, begins, totals, counts))
        out, at, first = [], 0, 0
        for j, (ids, n) in enumerate(zip(cluster_ids, n_runs.tolist(), strict=True)):
            end = first + ids.size
            out.append(Lookup(totals[j], cached[first:end].reshape(ids.shape),
                              begins[first:end].reshape(ids.shape), counts=counts[j],
                              runs=plan[at:at + n]))
            at, first = at + n, end
        return out

    def lookup_tokens(self, cluster_ids: np.ndarray, offsets: np.ndarray,
                      page_block: np.ndarray) -> Lookup:
        """Locate single tokens: token i of head h is token ``offsets[h, i]`` of cluster
        ``cluster_ids[h, i]`` ([H, k] int64 each; clusters stored in token order, as
        position blocks are). Read-only, numpy only. The Lookup's ``cached`` is per token
        (its cluster is cached) and ``begins`` is each token's slot."""
        c = self.num_clusters
        if cluster_ids.size and (cluster_ids.min() < 0 or cluster_ids.max() >= c):
            bad = cluster_ids[(cluster_ids < 0) | (cluster_ids >= c)][0]
            raise ValueError(f"cluster id {int(bad)} is out of range; accepted: 0 to {c - 1}")
        h, k = cluster_ids.shape
        rows = np.arange(h)[:, None]
        sizes = self.size[rows, cluster_ids]
        if offsets.size and ((offsets < 0) | (offsets >= sizes)).any():
            raise ValueError("a token offset is outside its cluster")
        host_row = self.page_start[rows, cluster_ids] * self.page_size + offsets
        block = page_block[host_row // self.page_size]
        hit = block >= 0
        kind = np.where(hit, HIT, MISS).astype(np.int32)
        src_row = np.where(hit, block * self.page_size + host_row % self.page_size, host_row)
        totals = np.full(h, k, dtype=np.int64)
        cached = np.take_along_axis(self.cached, cluster_ids, axis=1)
        begins = np.broadcast_to(np.arange(k, dtype=np.int64), (h, k))
        return Lookup(totals, cached, begins, kind, src_row, host_row)
