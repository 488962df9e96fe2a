"""The wave buffer's :class:`~vllm_retro.index.store.ClusterStore` for one (request, layer).

A store is small integer state -- its mapping table (where each cluster's tokens are) and
the extents of host pages it was given -- over its layer's pools
(:mod:`vllm_retro.buffer.layer_pool`), which hold the bytes for every request of the layer.

Per decode step (RetroInfer §4.3) ``gather`` looks the retrieval clusters up in the mapping
table (read-only) and assembles the execution buffer from the steady zone and the clusters'
host rows (host->device on CUDA, one gather over the plan's runs). The device's cache of
clusters is not a store's: the device step keeps one per layer, its tables on the device
(:mod:`vllm_retro.kernels.cluster_cache`), which is how the GPU serves; this path is the
reference and the fallback.

At prefill (and at every index update) ``append`` hands the clustered block's layout work
(cluster-contiguous pages, mapping-table entries) to the worker; into a pinned pool (CUDA)
the block is first laid out on its device in page order, and the worker copies it into its
extent in one piece per array (a side stream), with no staging buffer.
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
from vllm_retro.buffer.mapping import ClusterMappingTable, Lookup
from vllm_retro.config import RetroConfig
from vllm_retro.index.clustering import Clusters
from vllm_retro.index.store import SteadyParts, fill_steady
from vllm_retro.kernels import cpu_ext

if TYPE_CHECKING:
    from vllm_retro.buffer.layer_pool import LayerPool

logger = logging.getLogger(__name__)

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
    its mapping table and host extents."""

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
        self.table = ClusterMappingTable(self.num_heads, self.page_size)
        self._extents: list[tuple[int, int]] = []
        """(first page, pages) of the host extents laid out for this store (worker)."""
        self._pending: Future | None = None
        self._growing: Future | None = None
        """The host pool's growth for the next block, queued after a layout (nothing waits
        for it but the next layout, behind it in the worker's queue, and :meth:`free`)."""
        self._settled = False
        """Whether the index build's layout is done (:meth:`settle` ran once)."""
        self._freed = False
        self.compiled = cpu_ext.load()
        """The compiled extension whose ``buffer_lookup`` does the decode step's table work
        (None: numpy, the reference, as when it cannot be built)."""
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
        self.sync()  # one layout at a time: a store's extents are laid out in order
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

    # ------------------------------------------------------------------ decode
    def sync(self) -> None:
        """Wait for this store's pending layout."""
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
        n_steady = fill_steady(steady, exec_k, exec_v)
        self.read(lk, n_steady, exec_k, exec_v)
        pos = np.where(lk.host_row >= 0,
                       self.host.positions.numpy()[np.maximum(lk.host_row, 0)], -1)
        positions = torch.from_numpy(pos).to(self.device)
        totals = torch.from_numpy(lk.totals + n_steady).to(self.device)
        return exec_k, exec_v, positions, totals

    def gather_into(self, cluster_ids: np.ndarray, n_steady: int,
                    dst_k: torch.Tensor, dst_v: torch.Tensor) -> None:
        """See :meth:`ClusterStore.gather_into`: the lookup runs on the host copy of the ids,
        the read as in :meth:`gather`."""
        self.read(self.lookup(cluster_ids), n_steady, dst_k, dst_v)

    def ready(self) -> None:
        """Before a lookup: the store is live and its layout is done."""
        if self._freed:
            raise RuntimeError("this wave buffer store was freed")
        self.sync()

    def lookup(self, ids: np.ndarray) -> Lookup:
        """Wait for this store's layout, then look ``ids`` ([H, R]) up."""
        self.ready()
        return self.table.lookup(ids)

    def lookup_into(self, ids: np.ndarray, plan: np.ndarray, at: int, row0: int, col0: int,
                    t_cap: int) -> Lookup:
        """:meth:`lookup`, writing the tokens' places into a layer's gather plan (``plan``
        [N, 3] int64 runs from entry ``at``; this store's head h goes to execution-buffer
        row ``row0 + h`` of ``t_cap`` slots from slot ``col0``; see
        :meth:`ClusterMappingTable.lookup_into`), compiled when :attr:`compiled` is set."""
        if self.compiled is None:
            return self.lookup(ids).write_into(plan, at, row0, col0, t_cap)
        self.ready()
        return self.table.lookup_into(self.compiled, ids, self.host.capacity_pages, plan, at,
                                      row0, col0, t_cap)

    def read(self, lk: Lookup, n_steady: int, exec_k: torch.Tensor, exec_v: torch.Tensor
             ) -> None:
        """Copy the tokens of ``lk`` from the host pool into ``exec_k``/``exec_v`` ([H, T_cap,
        D]) after their first ``n_steady`` rows (the steady zone, already there), and count
        the read."""
        self.pool.gather(lk.plan(0, n_steady, exec_k.shape[1]), exec_k, exec_v,
                         self.config.kernel_backend)
        self.count(lk, n_steady)

    def count(self, lk: Lookup, n_steady: int) -> None:
        """Count a step's reads in the buffer's statistics: ``lk``'s tokens from the host
        pool (and, for a cluster lookup, its clusters and their pages), the steady zone's
        ``n_steady`` rows per KV head on the device."""
        row_bytes = 2 * self.head_dim * self.host.k.element_size()
        if lk.counts is not None:
            tokens, pages = lk.counts.tolist()
            extra = dict(device_cache_miss_clusters=lk.begins.size, pages_h2d=pages)
        else:
            tokens, extra = int(lk.totals.sum()), {}
        self.stats.add(miss_tokens=tokens, host_to_device_bytes=tokens * row_bytes,
                       bytes_d2d=n_steady * self.num_heads * row_bytes, **extra)

    # ------------------------------------------------------------------ token reads
    def gather_tokens_into(self, cluster_ids: np.ndarray, offsets: np.ndarray,
                           n_steady: int, dst_k: torch.Tensor, dst_v: torch.Tensor
                           ) -> None:
        """Fill ``dst_k``/``dst_v`` ([H, T_cap, D]) after the steady zone (their first
        ``n_steady`` rows, already there) with single tokens from the host pool: token i of
        head h is token ``offsets[h, i]`` of cluster ``cluster_ids[h, i]`` ([H, k] int64
        numpy; clusters in token order)."""
        self.read(self.lookup_tokens(cluster_ids, offsets), n_steady, dst_k, dst_v)

    def lookup_tokens(self, cluster_ids: np.ndarray, offsets: np.ndarray) -> Lookup:
        """Wait for this store's layout, then look the tokens up."""
        self.ready()
        return self.table.lookup_tokens(cluster_ids, offsets)

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

    def check_invariants(self) -> None:
        """Raise AssertionError unless every cluster's pages lie in one of this store's host
        extents and hold its tokens. Waits for pending layouts first. For tests and
        debugging."""
        self.sync()
        t = self.table
        ext = sorted(self._extents)
        for h in range(self.num_heads):
            for c in range(t.num_clusters):
                first, n = int(t.page_start[h, c]), int(t.n_pages[h, c])
                assert n * self.page_size >= t.size[h, c], f"head {h} cluster {c}: pages"
                assert any(s <= first and first + n <= s + p for s, p in ext), \
                    f"head {h} cluster {c}: outside the store's extents"

    # ------------------------------------------------------------------ lifecycle
    def nbytes(self) -> int:
        """Host bytes of the pages this store holds in the layer's pool."""
        return sum(n for _, n in self._extents) * self.host.page_nbytes()

    def free(self) -> None:
        """See :meth:`ClusterStore.free`: waits for pending work, gives the store's host
        extents back to the layer's pool (released with the last store)."""
        if self._freed:
            return
        try:
            self.sync()
            self._join_growth()
        except Exception as exc:  # a failed layout or growth: reported where it was met
            logger.warning("retro: freeing the store of request %s after its failed host-tier "
                           "work (%s)", self.request_id, exc)
        finally:
            self._growing = None
            self._freed = True
            for first, pages in self._extents:
                self.host.release(first, pages)
            self._extents = []
            self.table = ClusterMappingTable(self.num_heads, self.page_size)
            self.pool.detach(self)
