"""A layer's device cache of retrieval clusters, for the device step that reads its tokens in
place from pinned host memory (the wave buffer's block cache, kept on the device).

Read in place (:mod:`vllm_retro.index.device_layer`, ``in_place``), every retrieved token
crosses PCIe, ~80x slower per byte than device memory (DESIGN.md, "The GPU decode step"), so
the step keeps the clusters it retrieves in a device cache and reads them there while they
stay hot. State per pool row ``p`` (one (request slot, KV head)), preallocated:

- ``keys``, ``values`` ``[P * S * T + 1, D]``: ``S`` blocks of ``T`` tokens per pool row;
  block ``s`` of row ``p`` holds the first ``min(size, T)`` tokens of one cluster from row
  ``(p * S + s) * T``. The last row is a sink for the torch path's masked writes;
- ``block_of`` [P, C_cap + 1] int32: the block holding cluster ``c``, -1 when it is not
  cached (column C_cap: a sink for masked writes);
- ``cluster_of`` [P, S + 1] int32: the cluster block ``s`` holds, -1 when free;
- ``stamp`` [P, S + 1] int64: the last step that read or filled each block (LRU);
- ``counts`` [P, 4] int64, summed over the steps: retrieval tokens read from the cache,
  retrieval tokens read in place (over the bus), retrieval clusters found in the cache
  (hits), clusters not found (misses) — what the hit ratio and the bus traffic are made
  of, read by the host only when reported.

A step's :func:`cache_lookup` runs on the device before the attention, one program per row
(no host synchronisation): the retrieval zone's clusters that are cached are hits (their
blocks stamped with the step), the others misses; the ``k``-th miss of a row is admitted
into the row's ``k``-th least recently used block that no hit of the step holds (the
evicted cluster unmapped), as long as such blocks remain. It returns each retrieval run's
cache row and whether it is read there; the attention reads a hit's first ``T`` tokens from
the cache, everything else in place, and writes an admitted miss's first ``T`` tokens into
its block as it reads them — each missed byte crosses the bus once. A cluster larger than a
block has its first ``T`` tokens cached and the rest read in place.

The step's counter (the plan's ``step`` field) must grow by at least one per step of the
layer; stamps start at 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_retro.kernels._common import block_size, tl, triton
from vllm_retro.kernels.step_plan import flat_meta, plan_rows


@dataclass(frozen=True)
class ClusterCache:
    """A layer's cluster cache (see the module docstring); made by :meth:`allocate`."""

    keys: torch.Tensor
    """[P * S * T + 1, D] cached keys (the last row a sink for masked writes)."""
    values: torch.Tensor
    """[P * S * T + 1, D]."""
    block_of: torch.Tensor
    """[P, C_cap + 1] int32 block of each cluster, -1: not cached."""
    cluster_of: torch.Tensor
    """[P, S + 1] int32 cluster of each block, -1: free."""
    stamp: torch.Tensor
    """[P, S + 1] int64 last step each block was read or filled."""
    counts: torch.Tensor
    """[P, 4] int64: retrieval tokens read from the cache, tokens read in place, clusters
    found in the cache, clusters not found."""
    block_tokens: int
    """T: tokens per block."""

    @staticmethod
    def allocate(rows: int, clusters: int, blocks: int, block_tokens: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> ClusterCache:
        """An empty cache: ``blocks`` blocks of ``block_tokens`` tokens for each of ``rows``
        pool rows of at most ``clusters`` clusters."""
        for name, v in (("rows", rows), ("clusters", clusters), ("blocks", blocks),
                        ("block_tokens", block_tokens), ("head_dim", head_dim)):
            if v < 1:
                raise ValueError(f"ClusterCache: {name}={v}; accepted: an integer >= 1")
        n = rows * blocks * block_tokens + 1
        return ClusterCache(
            keys=torch.zeros(n, head_dim, dtype=dtype, device=device),
            values=torch.zeros(n, head_dim, dtype=dtype, device=device),
            block_of=torch.full((rows, clusters + 1), -1, dtype=torch.int32, device=device),
            cluster_of=torch.full((rows, blocks + 1), -1, dtype=torch.int32, device=device),
            stamp=torch.zeros(rows, blocks + 1, dtype=torch.int64, device=device),
            counts=torch.zeros(rows, 4, dtype=torch.int64, device=device),
            block_tokens=block_tokens)

    @staticmethod
    def footprint(rows: int, clusters: int, blocks: int, block_tokens: int, head_dim: int,
                  dtype: torch.dtype) -> int:
        """Device bytes :meth:`allocate` takes for these bounds."""
        elem = torch.empty(0, dtype=dtype).element_size()
        kv = 2 * (rows * blocks * block_tokens + 1) * head_dim * elem
        return kv + rows * (4 * (clusters + 1) + 12 * (blocks + 1) + 32)

    @property
    def blocks(self) -> int:
        """S: blocks per pool row."""
        return self.cluster_of.shape[1] - 1

    def nbytes(self) -> int:
        """Device bytes held."""
        return sum(t.numel() * t.element_size() for t in (
            self.keys, self.values, self.block_of, self.cluster_of, self.stamp, self.counts))

    def clear_rows(self, rows: slice) -> None:
        """Forget what pool rows ``rows`` cache (a slot loaded with another index); their
        counters are kept."""
        self.block_of[rows] = -1
        self.cluster_of[rows] = -1
        self.stamp[rows] = 0


def cache_lookup_torch(cache: ClusterCache, sizes: torch.Tensor, plan: torch.Tensor,
                       top: torch.Tensor, r_max: int) -> torch.Tensor:
    """The reference (torch operations, no host synchronisation): look up and admit the
    retrieval zones ``top[:, :n_ret]`` (see the module docstring), updating ``cache``'s
    tables and counters. sizes [...] int32 the layer's cluster sizes (its meta rows, read
    flat by the plan's ``meta_row``, ``meta_stride``); plan
    [len(PLAN_FIELDS), B] int64 (:mod:`kernels.step_plan`); top [R, K] int64. Returns runs
    [2, R, r_max] int64: [0] the cache row of each retrieval cluster's token 0 (a hit's, or
    where an admitted miss goes), -1 for none; [1] 1 where the cluster is read from the
    cache (a hit), else 0."""
    r = top.shape[0]
    dev = top.device
    h = r // plan.shape[1]
    rows = plan_rows(plan, h)
    prow = rows.pool_row
    s, t = cache.blocks, cache.block_tokens
    c_cap = cache.block_of.shape[1] - 1
    clock = rows.step[:, None]
    ids = top[:, :r_max]
    keep = torch.arange(r_max, device=dev)[None, :] < rows.n_ret[:, None]
    size = torch.take(sizes, torch.where(keep, rows.meta_row[:, None] + ids, 0)).long() * keep
    sink_c = torch.full_like(ids, c_cap)
    blk = torch.where(keep, torch.take(cache.block_of, prow[:, None] * (c_cap + 1) + ids), -1)
    blk = blk.long()
    hit = blk >= 0
    sink_s = torch.full_like(blk, s)
    stamp = cache.stamp.index_select(0, prow)  # [R, S + 1]
    stamp.scatter_(1, torch.where(hit, blk, sink_s), clock.expand_as(blk))
    key = stamp[:, :s] * s + torch.arange(s, device=dev)[None, :]
    order = key.argsort(dim=1)  # least recently used first; the step's hits last
    miss = keep & ~hit
    rank = miss.long().cumsum(1) - 1
    admit = miss & (rank < s - hit.sum(1, keepdim=True))
    vict = torch.where(admit, torch.gather(order, 1, rank.clamp(0, s - 1)), -1)
    cluster_of = cache.cluster_of.index_select(0, prow).long()
    old = torch.where(admit, torch.gather(cluster_of, 1, vict.clamp_min(0)), -1)
    block_of = cache.block_of.index_select(0, prow)
    block_of.scatter_(1, torch.where(old >= 0, old, sink_c), -1)
    block_of.scatter_(1, torch.where(admit, ids, sink_c), vict.to(block_of.dtype))
    slot_s = torch.where(admit, vict, sink_s)
    cluster_of.scatter_(1, slot_s, ids)
    stamp.scatter_(1, slot_s, clock.expand_as(blk))
    cache.block_of.index_copy_(0, prow, block_of)
    cache.cluster_of.index_copy_(0, prow, cluster_of.to(cache.cluster_of.dtype))
    cache.stamp.index_copy_(0, prow, stamp)
    from_cache = (size.clamp_max(t) * hit).sum(1)
    n_hit = hit.sum(1)
    read = torch.stack([from_cache, size.sum(1) - from_cache, n_hit, keep.sum(1) - n_hit], 1)
    cache.counts.index_add_(0, prow, read)
    cached = torch.where(hit, blk, vict)
    row0 = torch.where(cached >= 0, (prow[:, None] * s + cached) * t, -1)
    return torch.stack([row0, hit.long()])


@triton.jit
def _cache_lookup_kernel(
    PLAN, TOP, SZ, BLK, CLU, STAMP, CNT, SCR, RUNS,
    B, H, C_CAP, S, T, R_MAX, s_top, s_run,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # one program per row: its stamps, the LRU order of its blocks and its admissions are
    # its own (no other program touches the row's tables)
    r = tl.program_id(0)
    b = r // H
    prow = (tl.load(PLAN + b) * H + r % H).to(tl.int64)
    nret = tl.load(PLAN + 3 * B + b)
    clock = tl.load(PLAN + 8 * B + b)  # PLAN_FIELDS: 'step'
    offs_r = tl.arange(0, BLOCK_R)
    keep = offs_r < nret
    cid = tl.load(TOP + r * s_top + offs_r, mask=keep, other=0)
    mrow = tl.load(PLAN + 9 * B + b) + (r % H) * tl.load(PLAN + 10 * B + b)  # meta rows
    size = tl.load(SZ + mrow + cid, mask=keep, other=0).to(tl.int64)
    blk = tl.load(BLK + prow * (C_CAP + 1) + cid, mask=keep, other=-1).to(tl.int64)
    hit = keep & (blk >= 0)
    tl.store(STAMP + prow * (S + 1) + blk, clock, mask=hit)
    tl.debug_barrier()
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < S
    stamp = tl.load(STAMP + prow * (S + 1) + offs_s, mask=smask, other=0)
    key = tl.where(smask, stamp * S + offs_s, 9223372036854775807)
    order = tl.sort(key) % S  # least recently used first; the step's hits last
    tl.store(SCR + prow * BLOCK_S + offs_s, order, mask=smask)
    tl.debug_barrier()
    miss = keep & (blk < 0)
    rank = tl.cumsum(miss.to(tl.int64), axis=0) - 1
    nhit = tl.sum(hit.to(tl.int64), axis=0)
    admit = miss & (rank < S - nhit)
    vict = tl.load(SCR + prow * BLOCK_S + rank, mask=admit, other=-1)
    old = tl.load(CLU + prow * (S + 1) + vict, mask=admit, other=-1)
    tl.store(BLK + prow * (C_CAP + 1) + old, -1, mask=admit & (old >= 0))
    tl.store(BLK + prow * (C_CAP + 1) + cid, vict.to(tl.int32), mask=admit)
    tl.store(CLU + prow * (S + 1) + vict, cid.to(tl.int32), mask=admit)
    tl.store(STAMP + prow * (S + 1) + vict, clock, mask=admit)
    from_cache = tl.sum(tl.where(hit, tl.minimum(size, T), 0), axis=0)
    tl.store(CNT + prow * 4, tl.load(CNT + prow * 4) + from_cache)
    tl.store(CNT + prow * 4 + 1, tl.load(CNT + prow * 4 + 1) + tl.sum(size, axis=0) - from_cache)
    tl.store(CNT + prow * 4 + 2, tl.load(CNT + prow * 4 + 2) + nhit)
    tl.store(CNT + prow * 4 + 3, tl.load(CNT + prow * 4 + 3) + tl.sum(miss.to(tl.int64), axis=0))
    cached = tl.where(hit, blk, vict)
    row0 = tl.where(cached >= 0, (prow * S + cached) * T, -1)
    out = offs_r < R_MAX
    tl.store(RUNS + r * s_run + offs_r, row0, mask=out)
    tl.store(RUNS + (tl.num_programs(0) + r) * s_run + offs_r, hit.to(tl.int64), mask=out)


def cache_lookup_triton(cache: ClusterCache, sizes: torch.Tensor, plan: torch.Tensor,
                        top: torch.Tensor, r_max: int) -> torch.Tensor:
    """Triton version of :func:`cache_lookup_torch` (same arguments, result and updates):
    one launch, one program per row."""
    r = top.shape[0]
    runs = torch.empty(2, r, r_max, dtype=torch.int64, device=top.device)
    if r == 0 or r_max == 0:
        return runs
    s = cache.blocks
    block_s = block_size(s)
    rows = cache.block_of.shape[0]
    scratch = torch.empty(rows, block_s, dtype=torch.int64, device=top.device)
    top = top.contiguous()
    _cache_lookup_kernel[(r,)](
        plan, top, flat_meta(sizes, 0), cache.block_of, cache.cluster_of, cache.stamp, cache.counts,
        scratch, runs, plan.shape[1], r // plan.shape[1], cache.block_of.shape[1] - 1, s,
        cache.block_tokens, r_max, top.stride(0), runs.stride(1),
        BLOCK_R=block_size(r_max), BLOCK_S=block_s)
    return runs
