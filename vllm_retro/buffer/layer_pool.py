"""The wave buffer's state of one attention layer: every request's store of that layer
shares one host page pool, one device block pool and (through them) one gather.

Layout (as vLLM's paged KV, one pool per layer, and nano-vllm's block manager):

- :class:`~vllm_retro.buffer.host_tier.HostTier`: the layer's host pages, extents per
  update block, plus the page -> device block map;
- :class:`~vllm_retro.buffer.block_cache.DeviceBlockPool`: the layer's device blocks, one
  free list, a budget per (request, KV head);
- per request, a :class:`~vllm_retro.buffer.store.WaveBufferStore` holding only small
  integer tables (its cluster descriptors, budgets, extents).

So the batched decode path (:func:`vllm_retro.index.padded.decode_padded`) fills the
execution buffer of all the layer's rows with one gather call over the two pools
(:meth:`gather_batch`) and copies all their admissions into the block pool with one call
(:meth:`join_batch`), whatever the number of requests, and hands the worker one job for all
their cache updates. The mapping-table lookups of all requests are one compiled call too
(``buffer_lookup_batch``, ``kernels/csrc/buffer_cpu.cpp``: the requests in parallel on
``RetroConfig.table_threads`` threads, without the GIL), written straight into the layer's
gather plan (kept across steps, as runs of consecutive rows:
:mod:`vllm_retro.kernels.gather`), and so are their cache updates, the worker's one job per
layer step (``buffer_update_batch``: each request's own table work in parallel, the block
pool's free stack in request order). Without the extension numpy does the same work
request by request. What stays per request is the steady-zone copies.

The pools live while the layer has a store; the last store's ``free`` releases them.

The host pool is preallocated, as vLLM sizes its KV cache once: the serving runtime gives
each layer a reservation of address space (``WaveBufferManager(pool_reserve_bytes=...)``,
twice the machine's memory over the attention layers) mapped once and committed page by page
as requests write it (:mod:`vllm_retro.buffer.host_tier`), so no request's pages are copied
when another one arrives and a released extent gives its memory back to the OS. Every path
uses the layer's pools, the fused CPU kernel's too (it reads the pool's pages in place).
``bench/layer_pool_build.py`` measures the build and memory cost against a pool per request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_retro import faults, kernels
from vllm_retro.buffer.block_cache import DeviceBlockPool
from vllm_retro.buffer.host_tier import HostTier
from vllm_retro.buffer.mapping import ClusterMappingTable, Lookup
from vllm_retro.buffer.stats import BufferStats
from vllm_retro.buffer.worker import UpdateWorker, deliver
from vllm_retro.config import CACHE_POLICIES
from vllm_retro.growth import grown

if TYPE_CHECKING:
    from vllm_retro.buffer.store import Plan, WaveBufferStore


def admission_runs(plan: Plan, src: np.ndarray, host: bool = False) -> np.ndarray:
    """The gather runs ([n, 3] int64: device-pool row, source row, count; negative counts
    for a host-pool source) of an admission ``plan``'s pages whose first source rows are
    ``src`` ([n] int64)."""
    _, _, rows, counts = plan
    return np.stack([rows, src, -counts if host else counts], axis=1).astype(np.int64,
                                                                          copy=False)


class LayerPool:
    """The host and device pools of one layer (one head layout, dtype and device)."""

    def __init__(self, num_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, stats: BufferStats,
                 on_empty: Callable[[LayerPool], None] | None = None, reserve_bytes: int = 0,
                 worker: UpdateWorker | None = None, host: HostTier | None = None,
                 block_cache: bool = True):
        """``reserve_bytes``: host address space the layer's page pool is mapped with at
        its first claim (committed as pages are written; 0: the pool grows as it fills),
        see :mod:`vllm_retro.buffer.host_tier`. ``worker``: the thread the stores' layout
        and cache-update jobs run on (None: a synchronous one of the pool's own: every job
        runs at submission). ``host``: the page pool (None: one made here, pinned when
        the device is CUDA; tests hand a pinned one over a fake driver). ``block_cache``:
        whether the stores keep clusters in the device block pool; False: they reserve no
        blocks and every read comes from the host pool (a CPU server's pools: there the
        "device" is host memory too, so a cached copy saves nothing and costs 5-35% of the
        indexed KV)."""
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
        self.blocks = DeviceBlockPool(head_dim, page_size, dtype, self.device, stats)
        self.block_cache = block_cache
        """Whether the layer's stores reserve blocks in :attr:`blocks` (their budgets)."""
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
        """Free both pools' memory (no store is left)."""
        self.host.free()
        self.blocks.free()

    def nbytes(self) -> tuple[int, int]:
        """(host bytes, device bytes) of the pools."""
        return self.host.nbytes(), self.blocks.nbytes()

    def gather_batch(self, stores: Sequence[WaveBufferStore], cluster_ids: Sequence[np.ndarray],
                     n_steady: Sequence[int], exec_k: torch.Tensor,
                     exec_v: torch.Tensor, offsets: Sequence[np.ndarray] | None = None
                     ) -> None:
        """Fill the execution buffer of all ``stores`` (this layer's, in row order: store j
        owns rows ``j * H .. (j + 1) * H``) and submit their cache updates (see
        :meth:`WaveBufferStore.gather_into`). cluster_ids[j]: [H, R_j] int64 numpy;
        n_steady[j]: the steady zone's rows at the front of store j's rows (filled by the
        caller); exec_k/exec_v: [B * H, T_cap, D] contiguous.
        ``offsets`` given: single tokens instead of whole clusters, token i of head h being
        token ``offsets[j][h, i]`` of cluster ``cluster_ids[j][h, i]`` (see
        :meth:`WaveBufferStore.gather_tokens_into`).
        One host-side lookup call for all stores (compiled: the stores in parallel; numpy,
        or token reads: one per store), one gather call and one worker job for every store's
        cache update."""
        h, t_cap = self.num_heads, exec_k.shape[1]
        # a store's runs are at most its tokens: H rows of at most t_cap each
        plan = self._plan(len(stores) * h * t_cap)
        at = 0
        updates: list[tuple] = []  # (update, its future) of each store begun
        batched = None
        if offsets is None and all(st.compiled is not None for st in stores):
            for st in stores:
                st.ready()
            batched = ClusterMappingTable.lookup_batch_into(
                stores[0].compiled, [st.table for st in stores], cluster_ids,
                self.host.page_block, plan, n_steady, t_cap,
                stores[0].config.table_threads_on(self.device.type))
        try:
            for j, (st, ids, ns) in enumerate(zip(stores, cluster_ids, n_steady, strict=True)):
                if batched is not None:
                    lk = batched[j]
                    fut = st.begin_step(ids, lk, ns, exec_k, exec_v, j * h)
                    update = None  # every store's is made by one call: update_batch
                elif offsets is None:
                    lk = st.lookup_into(ids, plan, at, j * h, ns, t_cap)
                    fut = st.begin_step(ids, lk, ns, exec_k, exec_v, j * h)
                    update = partial(st.update, ids, lk, ns)
                else:
                    lk = st.lookup_tokens(ids, offsets[j]).write_into(plan, at, j * h, ns,
                                                                      t_cap)
                    fut = st.begin_step(ids, lk, ns, None, None, 0)
                    update = partial(st.update_tokens, ids, lk)
                at += len(lk.runs)
                updates.append((update, fut))
        except BaseException:
            # no gather happens: the steps begun must not admit rows that were never filled
            for st in stores[:len(updates)]:
                st.abandon_step()
            raise
        # one worker job for the layer's step: every store's update, each delivered to that
        # store's own future (a store waits only for its part)
        if batched is not None:
            job = partial(self.update_batch, stores, cluster_ids, batched, n_steady,
                          [fut for _, fut in updates])
        else:
            job = partial(deliver, updates)
        self.worker.submit(job)
        self.gather(plan[:at], exec_k, exec_v, stores[0].config.kernel_backend)

    def update_batch(self, stores: Sequence[WaveBufferStore], cluster_ids: Sequence[np.ndarray],
                     lookups: Sequence[Lookup], n_steady: Sequence[int],
                     futures: Sequence[Future], threads: int | None = None) -> None:
        """The cache updates of a layer step's stores (worker thread): one compiled call
        (``buffer_update_batch``: the stores' own table work on ``table_threads`` threads,
        the pool's free stack in store order), with the result of each store's
        :meth:`WaveBufferStore.update` in store order. Each store's plan, or its error,
        goes to its own future; the block pool's lock is held throughout. ``threads``: None
        for ``RetroConfig.table_threads_on`` the pool's device."""
        first = stores[0]
        try:
            with self.blocks.lock:
                heads, slots, rows, counts, admitted, evicted, kinds, errors = \
                    first.compiled.buffer_update_batch(
                        [torch.from_numpy(np.ascontiguousarray(i)) for i in cluster_ids],
                        [torch.from_numpy(np.ascontiguousarray(lk.cached)) for lk in lookups],
                        [torch.from_numpy(np.ascontiguousarray(lk.begins)) for lk in lookups],
                        list(n_steady), [st.clock for st in stores],
                        [torch.from_numpy(st.table.records) for st in stores],
                        [torch.from_numpy(st.table.cached) for st in stores],
                        [torch.from_numpy(st.capacity) for st in stores],
                        torch.from_numpy(self.host.page_block), self.page_size,
                        torch.from_numpy(self.blocks.free_stack),
                        torch.from_numpy(self.blocks.n_free),
                        CACHE_POLICIES.index(first.config.cache_policy),
                        threads or first.config.table_threads_on(self.device.type))
        except BaseException as exc:  # the call itself was refused: no store was updated
            for fut in futures:
                fut.set_exception(exc)
            return
        admitted, evicted, kinds = admitted.tolist(), evicted.tolist(), kinds.tolist()
        self.blocks.stats.add(device_cache_admitted_pages=sum(admitted),
                              device_cache_evicted_pages=sum(evicted))
        for j, (st, ids, fut) in enumerate(zip(stores, cluster_ids, futures, strict=True)):
            kind = kinds[j]
            if faults.ENABLED and not kind:  # this store's update done, then reported failed
                try:
                    faults.check("update_worker", st.request_id)
                except faults.InjectedFault as exc:
                    fut.set_exception(exc)
                    continue
            if kind:
                fut.set_exception((ValueError if kind == 1 else RuntimeError)(errors[j]))
                continue
            st.clock += ids.shape[1]
            fut.set_result((heads[j].numpy(), slots[j].numpy(), rows[j].numpy(),
                            counts[j].numpy()))

    def gather(self, runs: np.ndarray, dst_k: torch.Tensor, dst_v: torch.Tensor,
               backend: str) -> None:
        """Copy the gather plan's ``runs`` ([N, 3] int64, :mod:`vllm_retro.kernels.gather`)
        from this layer's device block pool and host pool into ``dst_k``/``dst_v`` (viewed
        as rows)."""
        d = self.head_dim
        kernels.gather_runs(dst_k, dst_v, self.blocks.k.view(-1, d), self.blocks.v.view(-1, d),
                            *self.host.rows(), torch.from_numpy(runs), backend=backend)

    def _plan(self, entries: int) -> np.ndarray:
        """The gather plan's array for this step, [>= entries, 3] int64 runs, not cleared:
        each store's lookup writes its own runs after the ones before. Kept across steps
        (grown by >= 1.5x), since a fresh array costs a page fault per 4 KiB every step;
        only the entries written are ever touched."""
        if len(self._plan_runs) < entries:
            size = grown(entries, len(self._plan_runs))
            self._plan_runs = np.empty((size, 3), dtype=np.int64)
        return self._plan_runs

    def join_batch(self, stores: Sequence[WaveBufferStore]) -> None:
        """Join the cache updates of ``stores``' last steps (see
        :meth:`WaveBufferStore.step_done`): their admissions, copied out of the execution
        buffer they were gathered into, with one gather call for the layer (one run per
        admitted page)."""
        steps = [s for s in (st.take_step() for st in stores) if s is not None]
        if not steps:
            return
        backend = stores[0].config.kernel_backend
        for s in [s for s in steps if s[0] is None]:  # token reads: from the host tier
            self.admit(*s, backend=backend)
        steps = [s for s in steps if s[0] is not None]
        if not steps:
            return
        exec_k, exec_v = steps[0][0], steps[0][1]
        if any(s[0] is not exec_k for s in steps):  # not one buffer: one copy each
            for s in steps:
                self.admit(*s, backend=backend)
            return
        t_cap = exec_k.shape[1]
        runs = np.concatenate([admission_runs(plan, (row0 + plan[0]) * t_cap + plan[1])
                               for _, _, row0, plan in steps])
        self._copy_in(exec_k, exec_v, runs, backend)

    def admit(self, exec_k: torch.Tensor | None, exec_v: torch.Tensor | None, row0: int,
              plan: Plan, backend: str) -> None:
        """Copy one step's admissions (``plan``, see :data:`~vllm_retro.buffer.store.Plan`:
        execution-buffer places of the store's rows from ``row0``, or with ``exec_k`` None
        (token reads) host-pool rows) into the block pool."""
        heads, slots, _, _ = plan
        if exec_k is None or exec_v is None:
            self._copy_in(None, None, admission_runs(plan, slots, host=True), backend)
            return
        self._copy_in(exec_k, exec_v,
                      admission_runs(plan, (row0 + heads) * exec_k.shape[1] + slots), backend)

    def _copy_in(self, src_k: torch.Tensor | None, src_v: torch.Tensor | None,
                 runs: np.ndarray, backend: str) -> None:
        """Copy ``runs`` ([N, 3] int64, :mod:`vllm_retro.kernels.gather`: destination rows
        in the block pool) from ``src_k``/``src_v`` (viewed as rows; counts > 0) or the host
        pool (counts < 0; ``src_k`` None), by :meth:`DeviceBlockPool.write_runs`."""
        if runs.shape[0] == 0:
            return
        d = self.head_dim
        host_k, host_v = self.host.rows()
        self.blocks.write_runs(host_k if src_k is None else src_k.reshape(-1, d),
                               host_v if src_v is None else src_v.reshape(-1, d), host_k,
                               host_v, runs, backend)
        moved = 2 * int(np.abs(runs[:, 2]).sum()) * d * self.blocks.k.element_size()
        self.blocks.stats.add(**({"host_to_device_bytes": moved} if src_k is None else
                                 {"bytes_d2d": moved}))

    def check_invariants(self) -> None:
        """Raise AssertionError unless the free list and every store's mapped blocks
        partition the pool's blocks (none lost, none twice) and the budgets fit in it.
        Every store's pending work is joined first. For tests and debugging."""
        stores = list(self.stores)
        for st in stores:
            st.sync()
        mapped = [b for st in stores for b in st.mapped_blocks().tolist()]
        free = list(self.blocks.free_blocks)
        assert len(set(mapped)) == len(mapped), "a block mapped twice"
        assert len(set(free)) == len(free), "a block free twice"
        assert not set(mapped) & set(free), "a block both free and mapped"
        assert sorted(mapped + free) == list(range(self.blocks.num_blocks)), "blocks lost"
        budgets = sum(int(st.capacity.sum()) for st in stores)
        assert budgets == self.blocks.reserved <= self.blocks.num_blocks, "budgets"
