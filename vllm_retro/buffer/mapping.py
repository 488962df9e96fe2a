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

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_retro.kernels.gather import HIT, MISS


def runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], starts[i] + counts[i])`` over i ([n] int arrays)."""
    counts = counts.astype(np.int64)
    begin = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - begin, counts)


@dataclass(frozen=True)
class Lookup:
    """Where the tokens of one step's retrieval clusters come from."""

    kind: np.ndarray
    """[H, T] int32 per token slot: 0 padding, 1 device cache, 2 host tier."""
    src_row: np.ndarray
    """[H, T] int64 row in the device pool (hits) or the host pool (misses)."""
    host_row: np.ndarray | None
    """[H, T] int64 host row of every slot (-1 padding), e.g. for its token position; None
    from the compiled lookup (:meth:`ClusterMappingTable.lookup_into`)."""
    totals: np.ndarray
    """[H] int64 tokens per head."""
    cached: np.ndarray
    """[H, R] bool: the cluster was a cache hit."""
    begins: np.ndarray
    """[H, R] int64 first slot of each cluster within the head's retrieved tokens."""
    counts: np.ndarray | None = None
    """[4] int64 (hit tokens, miss tokens, cached clusters, host pages of the clusters not
    cached): set by cluster lookups, None for token reads."""

    def write_into(self, kind: np.ndarray, src: np.ndarray, row0: int, col0: int) -> None:
        """Write this lookup into a layer's gather plan (``kind``/``src`` [rows, T]): its
        heads own rows ``row0 ..``, ``kind`` written whole (the tokens from column ``col0``,
        0 elsewhere), ``src`` at the tokens (as the compiled lookup writes them)."""
        h, w = self.kind.shape
        kind[row0:row0 + h] = 0
        kind[row0:row0 + h, col0:col0 + w] = self.kind
        src[row0:row0 + h, col0:col0 + w] = self.src_row


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

    def pages_of_many(self, head: int, clusters: np.ndarray) -> np.ndarray:
        """The host pages of ``clusters`` ([n] ids of one head), concatenated in order."""
        return runs(self.page_start[head, clusters], self.n_pages[head, clusters])

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
        return Lookup(kind, src_row, host_row, totals, cached, begins, counts)

    def lookup_into(self, module: Any, cluster_ids: np.ndarray, page_block: np.ndarray,
                    kind: np.ndarray, src: np.ndarray, row0: int, col0: int) -> Lookup:
        """:meth:`lookup` by the compiled extension ``module`` (``buffer_lookup``, without
        the GIL), written straight into a layer's gather plan ``kind``/``src`` ([rows, T]
        int32 / int64): this table's heads own rows ``row0 .. row0 + H``, whose ``kind`` is
        written whole (the tokens from column ``col0``, 0 elsewhere) and whose ``src`` is
        written at the tokens. The Lookup's ``kind``/``src_row`` are views of those places
        (valid until the plan is reused), its ``host_row`` None and its ``counts`` set."""
        h = self.size.shape[0]
        cached, begins, totals, counts = module.buffer_lookup(
            torch.from_numpy(cluster_ids), torch.from_numpy(self.records),
            torch.from_numpy(self.cached), torch.from_numpy(page_block), self.page_size,
            torch.from_numpy(kind), torch.from_numpy(src), row0, col0)
        totals = totals.numpy()
        w = int(totals.max()) if totals.size else 0
        rows = slice(row0, row0 + h)
        return Lookup(kind[rows, col0:col0 + w], src[rows, col0:col0 + w], None, totals,
                      cached.numpy(), begins.numpy(), counts.numpy())

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
        return Lookup(kind, src_row, host_row, totals, cached, begins)
