"""The cluster mapping table of one (request, layer): where every cluster's tokens are in
its layer's host pool.

An array per field, indexed by (KV head, cluster id): the cluster's first page in the
layer's host pool, its page count and its size in tokens. Lookups only read it; the update
worker writes it when a block is laid out. The device's copy of the clusters a step reads
is the layer's business (the device step's cluster cache, :mod:`vllm_retro.kernels.cluster_cache`,
keeps its own tables on the device), so this table has no cache state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch


def runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], starts[i] + counts[i])`` over i ([n] int arrays)."""
    counts = counts.astype(np.int64)
    begin = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - begin, counts)


def token_runs(host_row: np.ndarray, row0: int, col0: int, t_cap: int) -> np.ndarray:
    """The gather plan's runs (:mod:`vllm_retro.kernels.gather`, [N, 3] int64, host rows:
    negative counts) of per-token host rows ``host_row`` ([H, T], -1 padding) whose head h
    goes to execution-buffer row ``row0 + h`` ([rows, t_cap]) from slot ``col0``: one run
    per maximal stretch of a head's consecutive slots with consecutive source rows (as the
    compiled lookup writes them)."""
    hh, tt = np.nonzero(host_row >= 0)
    s = host_row[hh, tt]
    start = np.ones(hh.size, dtype=bool)
    start[1:] = (hh[1:] != hh[:-1]) | (tt[1:] != tt[:-1] + 1) | (s[1:] != s[:-1] + 1)
    first = np.flatnonzero(start)
    length = np.diff(np.append(first, hh.size))
    out = np.empty((first.size, 3), dtype=np.int64)
    out[:, 0] = (row0 + hh[first]) * t_cap + col0 + tt[first]
    out[:, 1] = s[first]
    out[:, 2] = -length
    return out


@dataclass(frozen=True)
class Lookup:
    """Where the tokens of one step's retrieval clusters are in the host pool: per token
    (numpy lookups) or as runs in a layer's gather plan (the compiled lookup)."""

    totals: np.ndarray
    """[H] int64 tokens per head."""
    begins: np.ndarray
    """[H, R] int64 first slot of each cluster within the head's retrieved tokens."""
    host_row: np.ndarray | None = None
    """[H, T] int64 host row of every slot (-1 padding) (numpy lookups)."""
    counts: np.ndarray | None = None
    """[2] int64 (tokens read, host pages of the clusters read): set by cluster lookups,
    None for token reads."""
    runs: np.ndarray | None = None
    """[N, 3] int64: this lookup's runs in the gather plan it was written into (a view,
    valid until the plan is reused; the compiled lookup)."""

    def plan(self, row0: int, col0: int, t_cap: int) -> np.ndarray:
        """This lookup's gather-plan runs ([N, 3] int64) for execution-buffer rows ``row0
        ..`` ([rows, t_cap]) from slot ``col0``: see :func:`token_runs`."""
        if self.host_row is None:
            if self.runs is None:
                raise ValueError("this lookup has neither per-token places nor runs")
            return self.runs
        return token_runs(self.host_row, row0, col0, t_cap)

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


RECORD_FIELDS = ("page_start", "n_pages", "size")
"""The int64 fields of a cluster's record, in order (kernels/csrc/buffer_cpu.cpp reads
them by these positions)."""
RECORD_WIDTH = 8
"""int64 slots per record (the fields, then padding): one 64-byte cache line per
cluster."""


def _record_field(name: str, what: str) -> property:
    """The [H, C] int64 view of field ``name`` of :attr:`ClusterMappingTable.records`."""
    i = RECORD_FIELDS.index(name)
    return property(lambda self: self.records[..., i], doc=f"[H, C] int64 view: {what}.")


def _check_ids(cluster_ids: np.ndarray, c: int) -> None:
    if cluster_ids.size and (cluster_ids.min() < 0 or cluster_ids.max() >= c):
        bad = cluster_ids[(cluster_ids < 0) | (cluster_ids >= c)][0]
        raise ValueError(f"cluster id {int(bad)} is out of range; accepted: 0 to {c - 1}")


class ClusterMappingTable:
    """Cluster descriptors of one request's layer.

    The int64 fields are one record per (KV head, cluster) in :attr:`records` ([H, C, 8]),
    so a step that touches a cluster reads one cache line rather than one per field (the
    step's clusters are scattered over tables of up to ~0.5 MB per field at 128K tokens);
    :attr:`page_start` and the other fields are [H, C] views of it."""

    def __init__(self, num_heads: int, page_size: int):
        self.page_size = page_size
        self.records = np.zeros((num_heads, 0, RECORD_WIDTH), dtype=np.int64)
        """[H, C, 8] int64: per cluster its :data:`RECORD_FIELDS`, then padding."""

    page_start = _record_field("page_start", "first host page of each cluster")
    n_pages = _record_field("n_pages", "host pages of each cluster")
    size = _record_field("size", "tokens of each cluster")

    @property
    def num_clusters(self) -> int:
        """Clusters per head."""
        return int(self.records.shape[1])

    def add_clusters(self, page_start: np.ndarray, n_pages: np.ndarray, size: np.ndarray
                     ) -> None:
        """Append clusters ([H, c] arrays: first host page, pages, tokens). The records are
        replaced by a new array (a reader holding the old one keeps valid descriptors of the
        clusters before)."""
        h, c = size.shape
        new = np.zeros((h, c, RECORD_WIDTH), dtype=np.int64)
        for name, value in (("page_start", page_start), ("n_pages", n_pages), ("size", size)):
            new[..., RECORD_FIELDS.index(name)] = value
        self.records = np.concatenate([self.records, new], axis=1)

    def lookup(self, cluster_ids: np.ndarray) -> Lookup:
        """Locate every token of ``cluster_ids`` ([H, R] int64; read-only). Numpy only: the
        table lives on the host, and this runs per request and layer step."""
        _check_ids(cluster_ids, self.num_clusters)
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
        begins = np.cumsum(sizes, axis=1) - sizes
        pages = self.n_pages[rows, cluster_ids].sum()
        counts = np.array([flat.size, pages], dtype=np.int64)
        return Lookup(totals, begins, host_row, counts)

    def lookup_into(self, module: Any, cluster_ids: np.ndarray, pages: int, plan: np.ndarray,
                    at: int, row0: int, col0: int, t_cap: int) -> Lookup:
        """:meth:`lookup` by the compiled extension ``module`` (``buffer_lookup``, without
        the GIL; ``pages``: the host pool's), written straight into a layer's gather plan
        ``plan`` ([N, 3] int64 runs, :mod:`vllm_retro.kernels.gather`) from entry ``at``:
        this table's head h goes to execution-buffer row ``row0 + h`` ([rows, t_cap]) from
        slot ``col0``. The runs are those :func:`token_runs` makes of :meth:`lookup`'s
        places; the Lookup's ``runs`` is a view of them, its per-token field None and its
        ``counts`` set."""
        begins, totals, counts, n = module.buffer_lookup(
            torch.from_numpy(cluster_ids), torch.from_numpy(self.records), pages,
            self.page_size, torch.from_numpy(plan), at, row0, col0, t_cap)
        return Lookup(totals.numpy(), begins.numpy(), counts=counts.numpy(),
                      runs=plan[at:at + n])

    @staticmethod
    def lookup_batch_into(module: Any, tables: Sequence[ClusterMappingTable],
                          cluster_ids: Sequence[np.ndarray], pages: int, plan: np.ndarray,
                          col0: Sequence[int], t_cap: int, threads: int = 1) -> list[Lookup]:
        """:meth:`lookup_into` for every store of a layer's step in one compiled call
        (``buffer_lookup_batch``: the stores in parallel on ``threads`` OpenMP threads,
        without the GIL). Table j looks ``cluster_ids[j]`` ([H, R_j] int64; every table has
        H heads) up, its head h going to execution-buffer row ``j * H + h`` ([rows, t_cap])
        from slot ``col0[j]``; ``pages``: the host pool's they all live in; ``plan``
        ([>= len(tables) * H * t_cap, 3] int64: each table's runs are written into a region
        of its own first) ends up holding every table's runs from entry 0, table after
        table. The Lookups are those :meth:`lookup_into` returns, one per table."""
        if not tables:
            return []
        begins, totals, counts, n_runs = module.buffer_lookup_batch(
            [torch.from_numpy(i) for i in cluster_ids],
            [torch.from_numpy(t.records) for t in tables], pages, tables[0].page_size,
            torch.from_numpy(plan), list(col0), t_cap, threads)
        begins, totals, counts = (x.numpy() for x in (begins, totals, counts))
        out, at, first = [], 0, 0
        for j, (ids, n) in enumerate(zip(cluster_ids, n_runs.tolist(), strict=True)):
            end = first + ids.size
            out.append(Lookup(totals[j], begins[first:end].reshape(ids.shape),
                              counts=counts[j], runs=plan[at:at + n]))
            at, first = at + n, end
        return out

    def lookup_tokens(self, cluster_ids: np.ndarray, offsets: np.ndarray) -> Lookup:
        """Locate single tokens: token i of head h is token ``offsets[h, i]`` of cluster
        ``cluster_ids[h, i]`` ([H, k] int64 each; clusters stored in token order, as
        position blocks are). Read-only, numpy only. The Lookup's ``begins`` is each
        token's slot."""
        _check_ids(cluster_ids, self.num_clusters)
        h, k = cluster_ids.shape
        rows = np.arange(h)[:, None]
        sizes = self.size[rows, cluster_ids]
        if offsets.size and ((offsets < 0) | (offsets >= sizes)).any():
            raise ValueError("a token offset is outside its cluster")
        host_row = self.page_start[rows, cluster_ids] * self.page_size + offsets
        totals = np.full(h, k, dtype=np.int64)
        begins = np.broadcast_to(np.arange(k, dtype=np.int64), (h, k))
        return Lookup(totals, begins, host_row)
