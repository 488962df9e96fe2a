"""The wave buffer's :class:`~vllm_retro.index.store.ClusterStore` for one (request, layer).

A store is small integer state — its mapping table, per-head block budgets, the extents of
host pages it was given — over its layer's pools (:mod:`vllm_retro.buffer.layer_pool`),
which hold the bytes for every request of the layer.

Per decode step (RetroInfer §4.3):

1. ``gather``: wait for this store's previous update (normally long finished), look the
   retrieval clusters up in the mapping table (read-only), and assemble the shared execution
   buffer from the steady zone (device->device), cache hits (device->device) and misses
   (host->device); then submit the cache update to the worker and return.
2. the caller runs attention on the execution buffer while the worker records the reads in
   the mapping table, picks evictions by the policy's order and maps admitted clusters to
   blocks (one compiled call for the layer's stores, ``buffer_update_batch``; numpy over
   all heads at once is the reference);
3. ``step_done``: take the worker's decision and copy the admitted clusters from the
   execution buffer into their blocks, before anything reuses that buffer.

At prefill (and at every index update) ``append`` hands the clustered block's layout work
(cluster-contiguous pages, mapping-table entries, cache budget) to the worker; into a pinned
pool (CUDA) the block is first laid out on its device in page order, and the worker copies
it into its extent in one piece per array (a side stream), with no staging buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_retro import faults
from vllm_retro.buffer.host_tier import bits
from vllm_retro.buffer.mapping import ClusterMappingTable, Lookup, runs
from vllm_retro.buffer.policy import admit_greedy, victims
from vllm_retro.buffer.worker import deliver
from vllm_retro.config import RetroConfig
from vllm_retro.index.clustering import Clusters
from vllm_retro.index.store import SteadyParts, fill_steady
from vllm_retro.kernels import cpu_ext
from vllm_retro.kernels.gather import HIT, MISS

if TYPE_CHECKING:
    from vllm_retro.buffer.layer_pool import LayerPool

logger = logging.getLogger(__name__)

Plan = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Admission copies, one entry per admitted page ([n] int64 each, head-major, read order):
(head, first execution-buffer slot, first device-pool row, tokens): the page's tokens are
consecutive in both. After token reads (:meth:`WaveBufferStore.gather_tokens_into`),
(empty, first host-pool row, first device-pool row, tokens)."""


def _page_plan(sizes: np.ndarray, need: np.ndarray, blocks: np.ndarray, page: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The pages of admitted clusters (``sizes`` [n] tokens, ``need`` [n] pages each, their
    ``blocks`` concatenated in order): (cluster index, first token within the cluster, first
    device-pool row, tokens), one entry per page."""
    which = np.repeat(np.arange(sizes.size), need)
    first = runs(np.zeros_like(need), need) * page  # each page's first token within
    return which, first, blocks * page, np.minimum(page, sizes[which] - first)


Layout = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]
"""Where a clustered block goes in its host extent, relative to the extent's first page
(:func:`_block_layout`)."""


def _block_layout(order: np.ndarray, sizes: np.ndarray, n_pages: np.ndarray, page: int
                  ) -> Layout:
    """The layout of a clustered block (``order`` [H, M] its tokens by cluster, ``sizes``
    and ``n_pages`` [H, c] each cluster's tokens and pages) in an extent of ``page``-row
    pages: each cluster from a page boundary, head-major. Returns (first page of each
    cluster [H, c], and per token in head-major cluster-contiguous order [H * M]: its row,
    its KV head, its token in the block; then the extent's rows), rows and pages from 0."""
    h, c = sizes.shape
    m = order.shape[1]
    flat_pages = n_pages.reshape(-1)
    page_start = (np.cumsum(flat_pages) - flat_pages).reshape(h, c)
    flat_sizes = sizes.reshape(-1)
    f = np.repeat(np.arange(h * c), flat_sizes)  # token t belongs to flat cluster f[t]
    rank = np.arange(h * m) - (np.cumsum(flat_sizes) - flat_sizes)[f]
    rows = page_start.reshape(-1)[f] * page + rank
    return page_start, rows, f // c, order.reshape(-1), int(flat_pages.sum()) * page


class WaveBufferStore:
    """One request's layer in its layer's :class:`~vllm_retro.buffer.layer_pool.LayerPool`:
    its mapping table, per-head block budgets and host extents."""

    def __init__(self, pool: LayerPool, config: RetroConfig,
                 exec_buffer: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 request_id: str | None = None):
        """``exec_buffer``: ``(num_heads, tokens, head_dim, dtype, device) -> (K, V)`` views
        of the execution buffer the per-row path (:meth:`gather`) assembles into
        (:meth:`~vllm_retro.buffer.manager.WaveBufferManager.exec_buffer`)."""
        self.request_id = request_id
        """The request whose layer this is (names it in errors and logs)."""
        self.pool = pool
        self.config = config
        self.exec_buffer = exec_buffer
        self.worker = pool.worker
        self.stats = pool.stats
        self.num_heads = pool.num_heads
        self.head_dim = pool.head_dim
        self.dtype = pool.dtype
        self.device = pool.device
        self.page_size = pool.page_size
        self.host = pool.host
        self.blocks = pool.blocks
        self.table = ClusterMappingTable(self.num_heads, self.page_size)
        self.capacity = np.zeros(self.num_heads, dtype=np.int64)
        """Device blocks each KV head may hold (its budget in the layer's block pool)."""
        self._extents: list[tuple[int, int]] = []
        """(first page, pages) of the host extents laid out for this store (worker)."""
        self._pending: Future | None = None
        self._growing: Future | None = None
        """The host pool's growth for the next block, queued after a layout (nothing waits
        for it but the next layout, behind it in the worker's queue, and :meth:`free`)."""
        self._step: tuple[torch.Tensor, torch.Tensor, int] | None = None
        """(execution buffer K, V, first row) of the step whose update is not joined yet."""
        self._settled = False
        """Whether the index build's layout is done (:meth:`settle` ran once)."""
        self.clock = 0
        """Reads recorded so far: the recency stamp of the next read (advanced by each cache
        update, on the worker)."""
        self._freed = False
        self._host_pages = np.zeros(self.num_heads, dtype=np.int64)
        self.compiled = cpu_ext.load()
        """The compiled extension whose ``buffer_lookup`` / ``buffer_update_batch`` do the decode
        step's table work (None: numpy, the reference, as when it cannot be built)."""
        pool.attach(self)

    @property
    def batch_group(self) -> LayerPool:
        """The stores decoded together share this: see
        :meth:`~vllm_retro.buffer.layer_pool.LayerPool.gather_batch` (the batched path's
        one gather per layer)."""
        return self.pool

    # ------------------------------------------------------------------ ingest
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               clusters: Clusters) -> None:
        """See :meth:`ClusterStore.append`. The block moves once its clustering gives its
        layout, on the worker: on CPU the worker scatters it into the host pages (both tiers
        are RAM); into a pinned pool (CUDA) it is laid out here, on its device, in page
        order, and the worker copies it straight into its pages (no staging buffer)."""
        order = clusters.order.cpu().numpy()
        sizes = clusters.sizes.cpu().numpy().astype(np.int64)
        n_pages = (sizes + self.page_size - 1) // self.page_size  # [H, c]
        pos = positions.cpu().numpy()
        self.sync()  # no update of this store may read the budgets while they grow
        self._grow_cache(n_pages.sum(axis=1))
        if self.host.pin:
            layout = _block_layout(order, sizes, n_pages, self.page_size)
            job = partial(self._ingest_rows, *self._page_order(keys, values, pos, layout),
                          layout[0], n_pages, sizes)
        else:
            job = partial(self._ingest, keys, values, pos, order, sizes, n_pages)
        worker = self.worker
        self._pending = worker.submit(job)
        # Room for the next update block, made now on the worker: the step that lands that
        # block then waits only for its own rows, never for the pool to be copied (at 16K
        # tokens x 8 heads a growth is ~70 ms, most of it first-touch page faults).
        self._growing = worker.submit(self._make_room)

    def _make_room(self) -> bool:
        """Grow the host pool for the next update block (worker thread)."""
        faults.check("update_worker", self.request_id)
        return self.host.ensure_room(self._block_pages())

    def _join_growth(self) -> None:
        """Wait for the room growth queued after the last layout. One that failed only
        costs time: the next layout grows the pool itself (:meth:`HostTier.reserve`)."""
        try:
            self.worker.wait(self._growing)
        except Exception as exc:
            logger.error("retro: growing the host pool for request %s failed (%s); its next "
                         "update block grows it", self.request_id, exc)
            self.stats.add(buffer_update_failures=1)
        finally:
            self._growing = None

    def _block_pages(self) -> int:
        """Host pages one update block can take at most: each head's tokens in pages, plus
        one partly filled page per cluster."""
        cfg = self.config
        per_head = -(-cfg.update_segment // self.page_size) + cfg.update_clusters
        return self.num_heads * per_head

    def _ingest(self, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray,
                order: np.ndarray, sizes: np.ndarray, n_pages: np.ndarray) -> None:
        """Lay a clustered block (``keys``/``values`` [H, M, D] on the CPU, ``positions``
        [M]) out in host pages (worker thread; numpy only, see
        :func:`vllm_retro.buffer.host_tier.bits`)."""
        faults.check("host_alloc_late" if self._settled else "host_alloc", self.request_id)
        page_start, rows, head, tok, _ = _block_layout(order, sizes, n_pages, self.page_size)
        pages = int(n_pages.sum())
        first = self.host.reserve(pages, headroom=self._block_pages())
        self._extents.append((first, pages))
        kb, vb = bits(keys.detach()), bits(values.detach())
        self.host.write_rows(first * self.page_size + rows, kb[head, tok], vb[head, tok],
                             positions[tok])
        self.table.add_clusters(first + page_start, n_pages, sizes)

    def _page_order(self, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray,
                    layout: Layout
                    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, torch.cuda.Event | None]:
        """The block (``keys``/``values`` [H, M, D], ``positions`` [M]) in its extent's page
        order, on its device: keys and values [pages * page_size, D] (padding rows zero) and
        positions [pages * page_size] (-1: padding); and the event after which the device
        holds them (None on CPU). One indexed read per array on the current stream."""
        _, rows, head, tok, total = layout
        src_head = np.zeros(total, dtype=np.int64)
        src_tok = np.zeros(total, dtype=np.int64)
        src_head[rows], src_tok[rows] = head, tok
        pos = np.full(total, -1, dtype=np.int64)
        pos[rows] = positions[tok]
        dev = keys.device
        hi, ti = torch.from_numpy(src_head).to(dev), torch.from_numpy(src_tok).to(dev)
        k_rows, v_rows = keys.detach()[hi, ti], values.detach()[hi, ti]
        pad = np.flatnonzero(pos < 0)
        if pad.size:
            pad_t = torch.from_numpy(pad).to(dev)
            k_rows.index_fill_(0, pad_t, 0)
            v_rows.index_fill_(0, pad_t, 0)
        ready = None
        if keys.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))
        return k_rows, v_rows, pos, ready

    def _ingest_rows(self, k_rows: torch.Tensor, v_rows: torch.Tensor, positions: np.ndarray,
                     ready: torch.cuda.Event | None, page_start: np.ndarray,
                     n_pages: np.ndarray, sizes: np.ndarray) -> None:
        """Claim the block's extent and copy it in, laid out already (:meth:`_page_order`;
        worker thread), then map its clusters."""
        faults.check("host_alloc_late" if self._settled else "host_alloc", self.request_id)
        first = self.host.claim_rows(k_rows, v_rows, positions, self._block_pages(), ready)
        self._extents.append((first, int(n_pages.sum())))
        self.table.add_clusters(first + page_start, n_pages, sizes)

    def _grow_cache(self, new_pages: np.ndarray) -> None:
        """Grow each head's block budget for ``new_pages`` ([H]) more host pages (none in a
        pool without a block cache)."""
        cfg = self.config
        self._host_pages += new_pages
        if not self.pool.block_cache:
            return
        for h in range(self.num_heads):
            tokens = int(self._host_pages[h]) * self.page_size
            target = -(-cfg.cache_tokens(tokens) // self.page_size)
            grow = max(0, target - int(self.capacity[h]))
            self.blocks.reserve(grow)
            self.capacity[h] += grow

    # ------------------------------------------------------------------ decode
    def sync(self) -> None:
        """Wait for this store's pending worker job; a decode step's update the caller has
        not joined yet is joined first (its admission plan must not be dropped)."""
        if self._step is not None:
            self.step_done()
        self.worker.wait(self._pending)
        self._pending = None

    def gather(self, cluster_ids: torch.Tensor, steady: SteadyParts
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :meth:`ClusterStore.gather` (into the manager's shared execution buffer)."""
        ids = cluster_ids.detach().to("cpu", torch.int64).numpy()
        lk = self.lookup(ids)
        n_steady = sum(int(sk.shape[1]) for sk, _ in steady)
        t = n_steady + int(lk.totals.max()) if self.num_heads else 0
        exec_k, exec_v = self.exec_buffer(self.num_heads, t, self.head_dim, self.dtype,
                                          self.device)
        self._fill(ids, lk, fill_steady(steady, exec_k, exec_v), exec_k, exec_v)
        pos = np.where(lk.host_row >= 0,
                       self.host.positions.numpy()[np.maximum(lk.host_row, 0)], -1)
        positions = torch.from_numpy(pos).to(self.device)
        totals = torch.from_numpy(lk.totals + n_steady).to(self.device)
        return exec_k, exec_v, positions, totals

    def gather_into(self, cluster_ids: np.ndarray, n_steady: int,
                    dst_k: torch.Tensor, dst_v: torch.Tensor) -> None:
        """See :meth:`ClusterStore.gather_into`: the lookup runs on the host copy of the ids,
        the fill as in :meth:`gather`, and the cache update is submitted the same way."""
        self._fill(cluster_ids, self.lookup(cluster_ids), n_steady, dst_k, dst_v)

    def ready(self) -> None:
        """Before a lookup: the store is live and its previous update is done."""
        if self._freed:
            raise RuntimeError("this wave buffer store was freed")
        self.sync()

    def lookup(self, ids: np.ndarray) -> Lookup:
        """Wait for this store's previous update, then look ``ids`` ([H, R]) up."""
        self.ready()
        return self.table.lookup(ids, self.host.page_block)

    def lookup_into(self, ids: np.ndarray, plan: np.ndarray, at: int, row0: int, col0: int,
                    t_cap: int) -> Lookup:
        """:meth:`lookup`, writing the tokens' places into a layer's gather plan (``plan``
        [N, 3] int64 runs from entry ``at``; this store's head h goes to execution-buffer
        row ``row0 + h`` of ``t_cap`` slots from slot ``col0``; see
        :meth:`ClusterMappingTable.lookup_into`), compiled when :attr:`compiled` is set."""
        if self.compiled is None:
            return self.lookup(ids).write_into(plan, at, row0, col0, t_cap)
        self.ready()
        return self.table.lookup_into(self.compiled, ids, self.host.page_block, plan, at,
                                      row0, col0, t_cap)

    def _fill(self, ids: np.ndarray, lk: Lookup, n_steady: int, exec_k: torch.Tensor,
              exec_v: torch.Tensor) -> None:
        """Assemble the execution buffer ``exec_k``/``exec_v`` ([H, T_cap, D]) after its
        first ``n_steady`` rows (the steady zone, already there): cache hits and host
        misses; then submit the step's cache update to the worker (joined by
        :meth:`step_done`)."""
        self._gather(lk.plan(0, n_steady, exec_k.shape[1]), exec_k, exec_v)
        self._submit(ids, lk, n_steady, exec_k, exec_v, 0)

    def _gather(self, runs: np.ndarray, dst_k: torch.Tensor, dst_v: torch.Tensor) -> None:
        """Copy the gather plan's ``runs`` ([N, 3] int64) from the layer's pools into
        ``dst_k``/``dst_v``."""
        self.pool.gather(runs, dst_k, dst_v, self.config.kernel_backend)

    def _submit(self, ids: np.ndarray, lk: Lookup, n_steady: int, exec_k: torch.Tensor,
                exec_v: torch.Tensor, row0: int) -> None:
        """Count the step's reads and submit its cache update; its admissions will be copied
        out of ``exec_k``/``exec_v`` ([rows, T_cap, D], this store's heads from ``row0``)."""
        fut = self.begin_step(ids, lk, n_steady, exec_k, exec_v, row0)
        self.worker.submit(partial(deliver, [(partial(self.update, ids, lk, n_steady), fut)]))

    def begin_step(self, ids: np.ndarray, lk: Lookup, n_steady: int,
                   exec_k: torch.Tensor | None, exec_v: torch.Tensor | None, row0: int
                   ) -> Future:
        """Count the step's reads and note where its admissions will come from (the
        execution buffer, this store's heads from row ``row0``; None: the host tier, for
        token reads). Returns the future the caller delivers the step's cache update to
        (the plan :meth:`update` or :meth:`update_tokens` returns, or its error), joined by
        :meth:`step_done` / :meth:`take_step`."""
        self._count(ids, lk, n_steady)
        self._step = (exec_k, exec_v, row0)
        self._pending = Future()
        return self._pending

    def abandon_step(self) -> None:
        """Forget a step begun (:meth:`begin_step`) whose gather never ran: its admissions
        must not be copied from rows that were never filled."""
        self._step = self._pending = None

    def _count(self, ids: np.ndarray, lk: Lookup, n_steady: int) -> None:
        """Count the step's reads (cluster reads by the lookup's counts; single-token reads,
        whose missed pages are read in part, by their slots, their clusters by their
        update)."""
        row_bytes = 2 * self.head_dim * self.host.k.element_size()
        clusters = {}
        if lk.counts is not None:  # a cluster lookup counted its reads
            hit_tok, miss_tok, cached, pages = lk.counts.tolist()
            clusters = dict(device_cache_hit_clusters=cached,
                            device_cache_miss_clusters=ids.size - cached, pages_h2d=pages)
        else:  # token reads: their update counts the clusters
            hit_tok = int((lk.kind == HIT).sum())
            miss_tok = int((lk.kind == MISS).sum())
        self.stats.add(
            hit_tokens=hit_tok, miss_tokens=miss_tok, host_to_device_bytes=miss_tok * row_bytes,
            bytes_d2d=(hit_tok + n_steady * self.num_heads) * row_bytes, **clusters,
        )

    def update(self, ids: np.ndarray, lk: Lookup, n_steady: int) -> Plan:
        """The cache update of one step (worker thread): record the reads, evict by the
        policy's order, admit the misses that fit, and plan their copies into the cache.
        Compiled when :attr:`compiled` is set (the layer pool's one call for a layer step,
        :meth:`~vllm_retro.buffer.layer_pool.LayerPool.update_batch`, of this store alone),
        else numpy over every KV head at once (no per-head or per-cluster Python work): the
        reference."""
        faults.check("update_worker", self.request_id)
        if self.compiled is not None:
            done: Future = Future()
            self.pool.update_batch([self], [ids], [lk], [n_steady], [done], threads=1)
            return done.result()
        t, page = self.table, self.page_size
        h_n, r = ids.shape
        rows = np.arange(h_n)[:, None]
        # a stamp per read, in read order (as reading them one by one would)
        t.last_access[rows, ids] = self.clock + 1 + np.arange(r)[None, :]
        self.clock += r
        t.reads[rows, ids] += lk.cached  # misses start at 1 when admitted
        protected = np.zeros(t.cached.shape, dtype=bool)
        protected[rows, ids] = True
        heads, pos, cand, blocks = self._admit(ids, ~lk.cached, protected)
        which, first, rows, count = _page_plan(t.size[heads, cand], t.n_pages[heads, cand],
                                               blocks, page)
        return (heads[which], n_steady + lk.begins[heads, pos][which] + first, rows, count)

    def _admit(self, cand: np.ndarray, want: np.ndarray, protected: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Admit the candidate clusters ``cand[h, j]`` where ``want[h, j]`` ([H, n] int64 and
        bool; each head's in priority order) within each head's block budget, evicting by
        the policy's order among its cached clusters not ``protected`` ([H, C] bool: this
        step's reads). A head whose misses do not all fit even after evicting everything
        evictable admits greedily (:func:`admit_greedy`; rare, the only per-head loop).
        Returns the admitted (head, position j, cluster) [n] each, head-major, and their
        device blocks in that order (each cluster's pages' blocks, concatenated)."""
        t = self.table
        rows = np.arange(self.num_heads)[:, None]
        need = t.n_pages[rows, cand]
        ok = want & (need > 0) & (need <= self.capacity[:, None])
        need = np.where(ok, need, 0)
        room = self.capacity - t.cached_pages()  # free blocks
        must = need.sum(axis=1) > room  # heads that must evict
        evicted = 0
        if must.any():
            # the evictable clusters of those heads, as flat lists: [H, C] is scanned once
            flat = np.flatnonzero(t.cached & ~protected & must[:, None])
            vh, vc = np.divmod(flat, t.num_clusters)
            vp = t.n_pages.reshape(-1)[flat]
            budget = room + np.bincount(vh, weights=vp, minlength=self.num_heads
                                        ).astype(np.int64)
            for h in np.nonzero(need.sum(axis=1) > budget)[0].tolist():
                idx = np.nonzero(ok[h])[0]
                drop = idx[~admit_greedy(need[h, idx], int(budget[h]))]
                ok[h, drop] = False
                need[h, drop] = 0
            vh, vc = victims(self.config.cache_policy, t.last_access, t.reads, vh, vc, vp,
                             need.sum(axis=1) - room)
            evicted = self._evict(vh, vc)
        heads, pos = np.nonzero(ok)
        cand = cand[heads, pos]
        need = need[heads, pos]
        total = int(need.sum())
        blocks = self.blocks.take(total) if total else np.zeros(0, dtype=np.int64)
        if total:
            self.host.page_block[runs(t.page_start[heads, cand], need)] = blocks
            t.cached[heads, cand] = True
            t.reads[heads, cand] = 1
        self.stats.add(device_cache_admitted_pages=total, device_cache_evicted_pages=evicted)
        return heads, pos, cand, blocks

    # ------------------------------------------------------------------ token reads
    ADMIT_BLOCKS = 32
    """Token reads (:meth:`gather_tokens_into`): clusters admitted per step and KV head at
    most, those holding the most of the step's tokens first (PQCache §3.4: the top
    k_cache = 32 blocks)."""

    def gather_tokens_into(self, cluster_ids: np.ndarray, offsets: np.ndarray,
                           n_steady: int, dst_k: torch.Tensor, dst_v: torch.Tensor
                           ) -> None:
        """Fill ``dst_k``/``dst_v`` ([H, T_cap, D]) after the steady zone (their first
        ``n_steady`` rows, already there) with single
        tokens: token i of head h is token ``offsets[h, i]`` of cluster ``cluster_ids[h, i]``
        ([H, k] int64 numpy; clusters in token order). Hits come from the device cache,
        misses from the host tier; the cache update (whole clusters, from the host tier) is
        submitted to the worker and joined by :meth:`step_done`."""
        lk = self.lookup_tokens(cluster_ids, offsets)
        self._gather(lk.plan(0, n_steady, dst_k.shape[1]), dst_k, dst_v)
        fut = self.begin_step(cluster_ids, lk, n_steady, None, None, 0)
        self.worker.submit(partial(deliver, [(partial(self.update_tokens, cluster_ids, lk),
                                              fut)]))

    def lookup_tokens(self, cluster_ids: np.ndarray, offsets: np.ndarray) -> Lookup:
        """Wait for this store's previous update, then look the tokens up."""
        self.ready()
        return self.table.lookup_tokens(cluster_ids, offsets, self.host.page_block)

    def update_tokens(self, cluster_ids: np.ndarray, lk: Lookup) -> Plan:
        """The cache update of a token-read step (worker thread). Per head, the clusters
        read are stamped, those holding more of the step's tokens as more recent, and
        cached ones count a read; then up to :attr:`ADMIT_BLOCKS` missed clusters, most
        tokens first, are admitted. Plan: (empty, host-pool rows, device-pool rows): whole
        clusters are copied from the host tier, since only some of their tokens were read.
        Every head at once, as :meth:`update`."""
        faults.check("update_worker", self.request_id)
        t, page = self.table, self.page_size
        h_n, k = cluster_ids.shape
        s = np.sort(cluster_ids, axis=1)
        new = np.ones(s.shape, dtype=bool)
        new[:, 1:] = s[:, 1:] != s[:, :-1]
        head, col = np.nonzero(new)  # each head's distinct clusters, ascending
        read = s[head, col]
        starts = np.flatnonzero(new.reshape(-1))
        count = np.diff(np.append(starts, s.size))  # tokens read from each
        # stamps: head after head, fewest tokens first (ties: lower id first)
        order = np.lexsort((read, count, head))
        t.last_access[head[order], read[order]] = self.clock + 1 + np.arange(read.size)
        self.clock += read.size
        cached = t.cached[head, read]
        t.reads[head, read] += cached
        # each head's missed clusters, most tokens first, at most ADMIT_BLOCKS
        miss = np.nonzero(~cached)[0]
        miss = miss[np.lexsort((read[miss], -count[miss], head[miss]))]
        mh = head[miss]
        rank = np.arange(miss.size) - np.searchsorted(mh, mh, side="left")
        miss, mh, rank = miss[rank < self.ADMIT_BLOCKS], mh[rank < self.ADMIT_BLOCKS], \
            rank[rank < self.ADMIT_BLOCKS]
        n = int(rank.max()) + 1 if rank.size else 0
        cand = np.zeros((h_n, n), dtype=np.int64)
        want = np.zeros((h_n, n), dtype=bool)
        cand[mh, rank] = read[miss]
        want[mh, rank] = True
        protected = np.zeros(t.cached.shape, dtype=bool)
        protected[head, read] = True
        self.stats.add(device_cache_hit_clusters=int(cached.sum()),
                       device_cache_miss_clusters=int((~cached).sum()))
        heads, _, cand, blocks = self._admit(cand, want, protected)
        which, first, rows, count = _page_plan(t.size[heads, cand], t.n_pages[heads, cand],
                                               blocks, page)
        return (np.zeros(0, dtype=np.int64), t.page_start[heads, cand][which] * page + first,
                rows, count)

    def _evict(self, heads: np.ndarray, clusters: np.ndarray) -> int:
        """Drop ``clusters`` ([n] ids, of ``heads`` [n]) from the cache; returns pages
        freed."""
        if clusters.size == 0:
            return 0
        t = self.table
        pages = runs(t.page_start[heads, clusters], t.n_pages[heads, clusters])
        blocks = self.host.page_block[pages].copy()  # a view would read back the -1s
        self.host.page_block[pages] = -1
        t.cached[heads, clusters] = False
        t.reads[heads, clusters] = 0
        self.blocks.give(blocks)
        return int(blocks.size)

    def settle(self) -> None:
        """Wait until the worker has laid out every block appended so far and made room for
        the next one."""
        self.sync()
        self._join_growth()
        self._settled = True

    def cluster_rows(self, wait: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """See :meth:`~vllm_retro.index.store.RowAddressedStore.cluster_rows`: the host tier's
        pages (cluster c of head h starts at page ``page_start[h, c]``). Waits for this
        store's pending work first, so the table and the pages are complete, unless
        ``wait`` is False: then the rows of the clusters laid out before that work are
        valid (the worker builds grown pools and tables as new objects and swaps them in
        whole, never changing rows already laid out), which is all an index reads while
        its newest block settles (``WaveIndex.store_settling``)."""
        if self._freed:
            raise RuntimeError("this wave buffer store was freed")
        if wait:
            self.sync()
        return (*self.host.rows(),
                # a contiguous copy of the records' column (the PQ kernel indexes it
                # densely); callers keep it until the layout or the index changes
                torch.from_numpy(np.ascontiguousarray(self.table.page_start)), 0,
                self.page_size)

    @property
    def layout_generation(self) -> int:
        """See :attr:`~vllm_retro.index.store.RowAddressedStore.layout_generation`: the host
        tier's pool generation (the worker replaces the pools when it grows them)."""
        return self.host.generation

    def step_done(self) -> None:
        """See :meth:`ClusterStore.step_done`: apply the admissions from the execution buffer."""
        step = self.take_step()
        if step is not None:
            self.pool.admit(*step, backend=self.config.kernel_backend)

    def take_step(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int, Plan] | None:
        """Join the last step's update: (execution buffer K, V (None: token reads, copied
        from the host tier), this store's first row in it, the admission copies' plan);
        None when no step is pending."""
        if self._step is None:
            return None
        exec_k, exec_v, row0 = self._step
        self._step = None
        try:
            plan = self.worker.wait(self._pending)
        except Exception as exc:  # the cache is only a cache: drop it, the reads go on
            self._pending = None
            self._drop_cache(exc)
            return None
        self._pending = None
        return exec_k, exec_v, row0, plan

    def _drop_cache(self, exc: BaseException) -> None:
        """After a failed cache update (``exc``): give back every device block this store
        maps and mark none of its clusters cached, whatever state the update left the
        table in; reads go to the host tier until the cache refills."""
        logger.error("retro: a device-cache update of request %s failed (%s); its device "
                     "cache is dropped and refills from the host tier", self.request_id, exc)
        freed = self.host.uncache(self._extents)
        if freed.size:
            self.blocks.give(freed)
        self.table.cached[:] = False
        self.table.reads[:] = 0
        self.stats.add(buffer_update_failures=1)

    def mapped_blocks(self) -> np.ndarray:
        """The device blocks this store's cached clusters hold ([n] int64)."""
        t = self.table
        h, c = np.nonzero(t.cached)
        return self.host.page_block[runs(t.page_start[h, c], t.n_pages[h, c])]

    def check_invariants(self) -> None:
        """Raise AssertionError unless the table, the budgets and the layer's pool agree:
        per head, a cluster is cached iff all its pages are mapped, exactly the cached
        clusters have a read count, and the blocks held (its cached clusters' pages) fit in the
        budget; then the pool's own check (free and mapped blocks partition it). Waits for
        pending updates first. For tests and debugging."""
        self.sync()
        t = self.table
        for h in range(self.num_heads):
            held = 0
            for c in range(t.num_clusters):
                blocks = self.host.page_block[t.pages_of(h, c)]
                if t.cached[h, c]:
                    assert (blocks >= 0).all(), f"head {h} cluster {c}: cached, pages unmapped"
                    held += blocks.size
                else:
                    assert (blocks < 0).all(), f"head {h} cluster {c}: not cached, pages mapped"
            assert held <= self.capacity[h], f"head {h}: blocks held"
            assert (t.reads[h] > 0).tolist() == t.cached[h].tolist(), f"head {h}: reads"
        self.pool.check_invariants()

    # ------------------------------------------------------------------ lifecycle
    def nbytes(self) -> int:
        """Host bytes of the pages this store holds in the layer's pool (see
        :meth:`device_nbytes` for the device tier)."""
        return sum(n for _, n in self._extents) * self.host.page_nbytes()

    def device_nbytes(self) -> int:
        """Device bytes of this store's block budgets in the layer's pool."""
        return int(self.capacity.sum()) * self.host.page_nbytes()

    def free(self) -> None:
        """See :meth:`ClusterStore.free`: waits for pending work, gives the store's blocks,
        budgets and host extents back to the layer's pools (released with the last store)."""
        if self._freed:
            return
        # a step's admissions not joined yet have no cache left to fill (and may be joined
        # here outside the inference mode their tensors were made in)
        self._step = None
        try:
            self.sync()
            self._join_growth()
        except Exception as exc:  # a failed layout or growth: reported where it was met
            logger.warning("retro: freeing the store of request %s after its failed host-tier "
                           "work (%s)", self.request_id, exc)
        finally:
            self._growing = None
            self._freed = True
            self._step = None
            self.blocks.give(self.mapped_blocks())
            self.blocks.unreserve(int(self.capacity.sum()))
            for first, pages in self._extents:
                self.host.release(first, pages)
            self._extents = []
            self.capacity[:] = 0
            self.table = ClusterMappingTable(self.num_heads, self.page_size)
            self.pool.detach(self)
