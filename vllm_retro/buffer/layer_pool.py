"""The wave buffer's state of one attention layer: every request's store of that layer
shares one host page pool and (through it) one gather.

Layout (as vLLM's paged KV, one pool per layer, and nano-vllm's block manager):

- :class:`~vllm_retro.buffer.host_tier.HostTier`: the layer's host pages, extents per
  update block;
- per request, a :class:`~vllm_retro.buffer.store.WaveBufferStore` holding only small
  integer tables (its cluster descriptors, extents).

So the batched decode path (:func:`vllm_retro.index.padded.decode_padded`) fills the
execution buffer of all the layer's rows with one gather call over the pool
(:meth:`gather_batch`), whatever the number of requests. The mapping-table lookups of all
requests are one compiled call too (``buffer_lookup_batch``, ``kernels/csrc/buffer_cpu.cpp``:
the requests in parallel on ``RetroConfig.table_threads`` threads, without the GIL), written
straight into the layer's gather plan (kept across steps, as runs of consecutive rows:
:mod:`vllm_retro.kernels.gather`). Without the extension numpy does the same work request by
request. What stays per request is the steady-zone copies.

The pool lives while the layer has a store; the last store's ``free`` releases it.

The host pool is preallocated, as vLLM sizes its KV cache once: the serving runtime gives
each layer a reservation of address space (``WaveBufferManager(pool_reserve_bytes=...)``,
twice the machine's memory over the attention layers) mapped once and committed page by page
as requests write it (:mod:`vllm_retro.buffer.host_tier`), so no request's pages are copied
when another one arrives and a released extent gives its memory back to the OS. Every path
uses the layer's pool, the fused CPU kernel's and the device step's too (they read the
pool's pages in place). ``bench/layer_pool_build.py`` measures the build and memory cost
against a pool per request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_retro import kernels
from vllm_retro.buffer.host_tier import HostTier
from vllm_retro.buffer.mapping import ClusterMappingTable
from vllm_retro.buffer.stats import BufferStats
from vllm_retro.buffer.worker import UpdateWorker
from vllm_retro.growth import grown

if TYPE_CHECKING:
    from vllm_retro.buffer.store import WaveBufferStore


class LayerPool:
    """The host pool of one layer (one head layout, dtype and device)."""

    def __init__(self, num_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, stats: BufferStats,
                 on_empty: Callable[[LayerPool], None] | None = None, reserve_bytes: int = 0,
                 worker: UpdateWorker | None = None, host: HostTier | None = None):
        """``reserve_bytes``: host address space the layer's page pool is mapped with at
        its first claim (committed as pages are written; 0: the pool grows as it fills),
        see :mod:`vllm_retro.buffer.host_tier`. ``worker``: the thread the stores' layout
        jobs run on (None: a synchronous one of the pool's own: every job runs at
        submission). ``host``: the page pool (None: one made here, pinned when the device
        is CUDA; tests hand a pinned one over a fake driver)."""
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        page_bytes = 2 * page_size * head_dim * torch.empty((), dtype=dtype).element_size()
        cuda = self.device.type == "cuda"  # the pool is read by this device's kernels
        self.host = host if host is not None else HostTier(
            head_dim, page_size, dtype, stats, pin=cuda,
            reserve_pages=reserve_bytes // page_bytes,
            fence=partial(torch.cuda.synchronize, self.device) if cuda else None)
        self.stats = stats
        self.worker = worker or UpdateWorker(stats, enabled=False)
        self.stores: set[WaveBufferStore] = set()
        self._on_empty = on_empty
        self._lock = threading.Lock()
        self._plan_runs = np.empty((0, 3), dtype=np.int64)

    def attach(self, store: WaveBufferStore) -> None:
        """Register a new store of this layer."""
        with self._lock:
            self.stores.add(store)

    def detach(self, store: WaveBufferStore) -> None:
        """A store was freed. Without stores the pools are released: by the owner's
        ``on_empty`` (which checks again under its own lock, so a store being created for
        the layer meanwhile keeps them), else here."""
        with self._lock:
            self.stores.discard(store)
            empty = not self.stores
        if self._on_empty is not None:
            self._on_empty(self)
        elif empty:
            self.release()

    def release(self) -> None:
        """Free the pool's memory (no store is left)."""
        self.host.free()

    def nbytes(self) -> int:
        """Host bytes of the pool."""
        return self.host.nbytes()

    def gather_batch(self, stores: Sequence[WaveBufferStore], cluster_ids: Sequence[np.ndarray],
                     n_steady: Sequence[int], exec_k: torch.Tensor,
                     exec_v: torch.Tensor, offsets: Sequence[np.ndarray] | None = None
                     ) -> None:
        """Fill the execution buffer of all ``stores`` (this layer's, in row order: store j
        owns rows ``j * H .. (j + 1) * H``; see :meth:`WaveBufferStore.gather_into`).
        cluster_ids[j]: [H, R_j] int64 numpy; n_steady[j]: the steady zone's rows at the
        front of store j's rows (filled by the caller); exec_k/exec_v: [B * H, T_cap, D]
        contiguous. ``offsets`` given: single tokens instead of whole clusters, token i of
        head h being token ``offsets[j][h, i]`` of cluster ``cluster_ids[j][h, i]`` (see
        :meth:`WaveBufferStore.gather_tokens_into`). One host-side lookup call for all
        stores (compiled: the stores in parallel; numpy, or token reads: one per store) and
        one gather call."""
        h, t_cap = self.num_heads, exec_k.shape[1]
        # a store's runs are at most its tokens: H rows of at most t_cap each
        plan = self._plan(len(stores) * h * t_cap)
        if offsets is None and all(st.compiled is not None for st in stores):
            for st in stores:
                st.ready()
            lookups = ClusterMappingTable.lookup_batch_into(
                stores[0].compiled, [st.table for st in stores], cluster_ids,
                self.host.capacity_pages, plan, n_steady, t_cap,
                stores[0].config.table_threads_on(self.device.type))
            at = sum(len(lk.runs) for lk in lookups)
        else:
            lookups, at = [], 0
            for j, (st, ids, ns) in enumerate(zip(stores, cluster_ids, n_steady, strict=True)):
                lk = st.lookup_into(ids, plan, at, j * h, ns, t_cap) if offsets is None else \
                    st.lookup_tokens(ids, offsets[j]).write_into(plan, at, j * h, ns, t_cap)
                lookups.append(lk)
                at += len(lk.runs)
        self.gather(plan[:at], exec_k, exec_v, stores[0].config.kernel_backend)
        for st, lk, ns in zip(stores, lookups, n_steady, strict=True):
            st.count(lk, ns)

    def gather(self, runs: np.ndarray, dst_k: torch.Tensor, dst_v: torch.Tensor,
               backend: str) -> None:
        """Copy the gather plan's ``runs`` ([N, 3] int64, :mod:`vllm_retro.kernels.gather`:
        host rows) from this layer's host pool into ``dst_k``/``dst_v`` (viewed as rows)."""
        host_k, host_v = self.host.rows()
        # no device pool: every run reads the host pool (the first pair is never read)
        kernels.gather_runs(dst_k, dst_v, host_k, host_v, host_k, host_v,
                            torch.from_numpy(runs), backend=backend)

    def _plan(self, entries: int) -> np.ndarray:
        """The gather plan's array for this step, [>= entries, 3] int64 runs, not cleared:
        each store's lookup writes its own runs after the ones before. Kept across steps
        (grown by >= 1.5x), since a fresh array costs a page fault per 4 KiB every step;
        only the entries written are ever touched."""
        if len(self._plan_runs) < entries:
            size = grown(entries, len(self._plan_runs))
            self._plan_runs = np.empty((size, 3), dtype=np.int64)
        return self._plan_runs
