"""Per-worker-process retro state: the wave buffer manager, the layers' states and the
requests' slots (:class:`~vllm_retro.vllm.layer_registry.LayerRegistry`), the index builder,
the requests' fates, the current step's plan, and counters. The runtime ties them together:
it builds indexes and registers them, takes them over from the builder at a request's
switch, and frees everything a request holds.

One instance per engine in each worker process (:func:`engine_runtime`), kept on the engine's
KV-transfer config and freed by the worker's connector at shutdown. The engine runs one step
at a time per worker, so the step plan is plain state.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from vllm_retro import faults
from vllm_retro.buffer.manager import WaveBufferManager
from vllm_retro.config import RetroConfig
from vllm_retro.index.graph_index import GraphIndex
from vllm_retro.index.pages import PAGE_INDEXES
from vllm_retro.index.pq_index import PQIndex
from vllm_retro.index.saap import SaapIndex
from vllm_retro.index.saap_model import load_saap
from vllm_retro.index.wave_index import WaveIndex
from vllm_retro.kernels import cpu_ext
from vllm_retro.vllm.counters import CounterDeltas, RetroCounters
from vllm_retro.vllm.heap import release_free_heap
from vllm_retro.vllm.index_builder import IndexBuilder
from vllm_retro.vllm.layer_registry import LayerRegistry
from vllm_retro.vllm.plan import RetroStepMetadata, RowStep
from vllm_retro.vllm.request_fates import RequestFates
from vllm_retro.vllm.settings import retro_config
from vllm_retro.vllm.stats import BUILD_SECONDS, COUNTERS, GAUGES, RetroConnectorStats

logger = logging.getLogger(__name__)

class RetroRuntime:
    """See module docstring."""

    def __init__(self, engine_config: object, config: RetroConfig) -> None:
        """The runtime of the engine ``engine_config`` (its ``VllmConfig``: the layer count
        and device sizing the host pools) with retro at ``config``."""
        self.config = config
        self._engine = engine_config
        self._manager: WaveBufferManager | None = None
        self._builder: IndexBuilder | None = None
        self._device_type = getattr(getattr(engine_config, "device_config", None),
                                    "device_type", "cpu")
        self.registry = LayerRegistry()
        """The layers' states (their requests' indexes and pools) and the requests' slots."""
        self._lock = threading.Lock()
        """Guards :attr:`_build_seconds` (read by the metrics' thread)."""
        self.step: RetroStepMetadata | None = None
        self._slot_to_req: dict[int, tuple[str, RowStep]] = {}
        self.counters = RetroCounters()
        self._deltas = CounterDeltas()
        """What :meth:`take_stats` reported last."""
        self._build_seconds: dict[str, float] = {}
        self.fates = RequestFates()
        """The requests decoding densely for life or failed, until the scheduler releases
        them (:meth:`demote`, :meth:`fail_request`)."""
        if self._device_type == "cpu":
            # the fused kernels, built now when missing: a build at the first index would
            # hold that engine step (and every request in it) for a minute or two
            cpu_ext.load()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        """A pickled or deep-copied engine config (another process's, a data-parallel
        engine's) carries no runtime: its engine makes its own (:func:`engine_runtime`)."""
        return _no_runtime, ()

    @property
    def manager(self) -> WaveBufferManager:
        """The engine's wave buffer manager in this process (created on first use)."""
        if self._manager is None:
            self._manager = WaveBufferManager(
                self.config, pool_reserve_bytes=pool_reserve_bytes(self._engine, self.config))
        return self._manager

    @property
    def builder(self) -> IndexBuilder:
        """The engine's index builder in this process (created on first use)."""
        if self._builder is None:
            steps = self.config.build_steps_on(self._device_type)
            self._builder = IndexBuilder(self._build, background=steps > 0)
        return self._builder

    # ------------------------------------------------------------------ steps
    def begin_step(self, meta: RetroStepMetadata) -> None:
        """Free the requests the scheduler released, seal the builds the previous step
        submitted, then publish this step's plan. A step that releases requests and
        schedules none (the engine goes idle) drops every layer's batched-decode state (the
        last batch's padded meta copy, its references to the freed rows' tensors, the
        execution buffer: nothing runs a layer again to drop them) and gives the C heap's
        free pages back to the OS, whichever requests ended last: indexed, dense for life,
        or never indexed."""
        for rid in meta.released:
            self.free_request(rid)
            self.fates.release(rid)
        if meta.released and not meta.rows:
            for state in self.registry.layers():
                state.meta_views.clear()
            release_free_heap()
        if self._builder is not None:
            self._builder.seal()
        self.step = meta
        self._slot_to_req = {row.slot: (rid, row) for rid, row in meta.rows.items()}
        self.counters.steps += 1

    def row_for_slot(self, slot: int) -> tuple[str, RowStep] | None:
        """The request whose last scheduled token of this step goes to ``slot``."""
        return self._slot_to_req.get(slot)

    # ------------------------------------------------------------------ indexes
    def _build(self, request_id: str, layer: str, keys: torch.Tensor, values: torch.Tensor,
               queries: torch.Tensor | None = None) -> WaveIndex:
        assert self.config is not None
        faults.check("index_build", request_id)
        store = self.manager.store(request_id, keys.shape[0], keys.shape[2], keys.dtype,
                                   keys.device, layer=layer)
        if self.config.index == "saap":  # the trained routing, checked against the model
            model = load_saap(self.config.saap.file,
                              getattr(getattr(self._engine, "model_config", None), "hf_config",
                                      None))
            index = SaapIndex.build(keys, values, self.config, store=store, model=model,
                                    layer=layer)
        elif self.config.index == "graph":  # trained on the prompt's last chunk's queries
            index = GraphIndex.build(keys, values, self.config, store=store, queries=queries)
        elif self.config.index in PAGE_INDEXES:
            index = PAGE_INDEXES[self.config.index].build(keys, values, self.config, store=store)
        elif self.config.index == "pqcache":
            index = PQIndex.build(keys, values, self.config, store=store)
        else:  # queries, under estimator='auto': scaled by the submitter (see submit_build)
            index = WaveIndex.build(keys, values, self.config, store=store,
                                    judge_queries=queries, judge_scale=1.0)
        # the host-tier layout (on the buffer's worker) is part of the build: done here, it
        # is never waited for by the first decode step
        store.settle()
        return index

    def submit_build(self, request_id: str, layer: str, keys: torch.Tensor,
                     values: torch.Tensor, read_seconds: float = 0.0,
                     queries: torch.Tensor | None = None) -> None:
        """Hand one layer of a request's prefilled KV (keys, values: [H_kv, N, D], a private
        copy, read back in ``read_seconds``; queries: None or [H, T, D] post-RoPE prefill
        queries, a private copy: for the graph index, or, times the layer's softmax scale,
        for the wave index's ``estimator='auto'``) to the index builder; :meth:`index`
        takes the index over at the request's switch. The read and, when the builder runs
        builds in the step, the build count as the step's index time."""
        t0 = time.perf_counter()
        self.builder.submit(request_id, layer, keys.shape[1], keys, values, read_seconds,
                            queries=queries)
        self.counters.index_step_seconds += read_seconds + time.perf_counter() - t0

    def build_index(self, request_id: str, layer: str, keys: torch.Tensor,
                    values: torch.Tensor) -> WaveIndex:
        """Index a request's prefilled KV for one layer at once, in the caller's thread.
        keys, values: [H_kv, N, D]."""
        index = self._build(request_id, layer, keys, values)
        self._register(request_id, layer, index)
        return index

    def _register(self, request_id: str, layer: str, index: WaveIndex) -> None:
        # the engine's thread: a layer's state changes only between forwards
        old, first = self.registry.register(request_id, layer, index)
        self.counters.indexes_built += 1
        self.counters.kv_heads = index.num_kv_heads
        if first:  # a request more: the live count changes only now
            self.counters.indexed_requests += 1
            self.counters.indexed_tokens += index.num_tokens
            self.counters.peak_live_requests = max(self.counters.peak_live_requests,
                                                   len(self.registry.live()))
        if old is not None:
            old.free()

    def note_build_time(self, request_id: str, seconds: float) -> None:
        """Add ``seconds`` (reading back KV and indexing it) to the request's index build
        time."""
        self.counters.index_build_seconds += seconds
        with self._lock:
            self._build_seconds[request_id] = self._build_seconds.get(request_id, 0.0) + seconds

    # ------------------------------------------------------------------ failures
    def switch(self, request_id: str) -> bool:
        """At ``request_id``'s switch step (the metadata build, before any layer runs):
        True when its indexes are here (taken over from the builder, waiting for it if
        needed); False when its build failed: then it is demoted (:meth:`demote`) and
        this step's rows, and all later ones, decode densely from its paged KV, which the
        scheduler keeps once told (``fates.take_demoted``)."""
        if self.fates.is_dense(request_id):
            return False
        if self.find_index_any(request_id):
            return True
        self.demote(request_id, "its index build failed")
        return False

    def demote(self, request_id: str, reason: str) -> None:
        """Decode ``request_id`` densely from its paged KV from now on (``reason``: why),
        freeing whatever it holds here."""
        logger.warning("retro: request %s decodes densely from its paged KV from now on: %s",
                       request_id, reason)
        self.free_request(request_id)
        self.fates.demote(request_id)
        self.counters.dense_fallback_requests += 1

    def fail_request(self, request_id: str, reason: str) -> None:
        """``request_id`` cannot go on (its index broke while decoding: ``reason``): free
        everything it holds; its rows compute nothing useful until the scheduler, told
        through :meth:`failed_blocks`, ends it with an error to its client."""
        if not self.fates.fail(request_id, reason):
            return
        logger.error("retro: request %s fails: %s", request_id, reason)
        self.free_request(request_id)
        self.counters.failed_requests += 1

    def failed_blocks(self, block_size: int) -> set[int]:
        """The KV-cache block each failed request of this step writes (its last scheduled
        token's): reported to the scheduler as blocks that failed to load, which ends the
        request with an error (vLLM's ``kv_load_failure_policy='fail'``)."""
        failed = self.fates.failed()
        if not failed or self.step is None:
            return set()
        return {row.slot // block_size for rid, row in self.step.rows.items() if rid in failed}

    def find_index_any(self, request_id: str) -> bool:
        """Whether ``request_id`` has its indexes here (taking them over from the builder,
        waiting for it, when they are not yet)."""
        held = self.registry.holds(request_id)
        if not held and self._builder is not None:
            self._take(request_id)
            held = self.registry.holds(request_id)
        return held

    def _take(self, request_id: str) -> None:
        assert self._builder is not None
        ready, waited = self._builder.take(request_id)
        self.counters.index_step_seconds += waited
        if ready is not None:
            for name, index in ready.indexes.items():
                self._register(request_id, name, index)
            self.note_build_time(request_id, ready.seconds)

    def find_index(self, request_id: str, layer: str) -> WaveIndex | None:
        """The index of ``request_id`` at ``layer`` (at the request's switch, taken over
        from the builder, waiting for it if needed), or None when it has none (never
        indexed here, or its background build failed)."""
        # every decode row of every layer: one lookup; the builder only at a switch
        index = self.registry.index(request_id, layer)
        if index is not None or not self.find_index_any(request_id):
            return index
        return self.registry.index(request_id, layer)

    def index(self, request_id: str, layer: str) -> WaveIndex:
        """:meth:`find_index`, with a clear error if the index does not exist."""
        index = self.find_index(request_id, layer)
        if index is None:
            raise RuntimeError(
                f"retro: no wave index for request {request_id!r} layer {layer!r}; the "
                "scheduler planned a retro decode for a request this worker never indexed")
        return index

    def free_request(self, request_id: str) -> bool:
        """Free every index and buffer byte of ``request_id`` (and cancel its builds);
        False if it held none."""
        if self._builder is not None:
            self.counters.index_step_seconds += self._builder.cancel(request_id)
        removed = self.registry.remove(request_id)
        if removed and self._builder is not None and self._builder.background and any(
                i.centroids.is_cuda for i in removed):
            # Their memory came from the builder's stream: the caching allocator may hand it
            # to the next build there at once, so the main stream's last reads must be done.
            torch.cuda.current_stream().synchronize()
        for index in removed:
            index.free()
        self.registry.release_slot(request_id)  # the last one out releases the pools
        if self._manager is not None:
            self._manager.free_request(request_id)
        if removed:
            self.counters.requests_released += 1
        return bool(removed)

    def _held_indexes(self) -> dict[str, list[WaveIndex]]:
        """Every index holding memory, by request id: those taken over at their request's
        switch and those the builder holds until then (built the step before, or in the
        background)."""
        held = dict(self._builder.built()) if self._builder is not None else {}
        for rid, indexes in self.registry.held().items():
            held[rid] = held.get(rid, []) + indexes  # the builder's lists stay as they are
        return held

    def live_bytes(self) -> tuple[int, int]:
        """(host bytes, device bytes) held by live requests: the wave buffer's tiers, the
        layers' steady-zone and meta pools, and each index's meta data (and steady zone) not
        in a layer's pool, built indexes not yet taken over included."""
        indexes = [i for held in self._held_indexes().values() for i in held]
        host = self._manager.host_bytes() if self._manager is not None else 0
        device = 0
        held = [(idx.meta_nbytes() + idx.steady_nbytes(), idx.centroids.is_cuda)
                for idx in indexes]
        held += [state.pools_nbytes() for state in self.registry.layers()]
        for nbytes, on_device in held:
            if on_device:
                device += nbytes
            else:
                host += nbytes
        return host, device

    def take_stats(self, rank: int) -> RetroConnectorStats:
        """This worker's payload for vLLM's connector-stats route: counter increments since
        the previous call, current gauges, and the index build time (seconds, all layers
        on this worker) of each request indexed since then."""
        deltas = self._deltas.take(self.counters, None if self._manager is None
                                   else self._manager.stats.snapshot())
        held = self._held_indexes()
        # a request counts from the step its build starts holding memory, not from its switch
        live = len(held.keys() | set(self._manager.live_requests()
                                     if self._manager is not None else ()))
        clusters = sum(i.num_clusters * i.num_kv_heads for d in held.values() for i in d)
        with self._lock:
            builds = list(self._build_seconds.values())
            self._build_seconds = {}
        host, device = self.live_bytes()
        if self._manager is not None:
            device += self._manager.exec_nbytes()
        r = str(rank)
        return RetroConnectorStats(data={
            COUNTERS: {r: deltas},
            GAUGES: {r: {"live_requests": live, "clusters": clusters, "host_tier_bytes": host,
                         "device_tier_bytes": device}},
            BUILD_SECONDS: {r: builds} if builds else {},
        })

    def close(self) -> None:
        """Free every request, stop the index builder, free the buffer manager (execution
        buffers, worker thread) and drop the layers' pools: the engine's worker is shutting
        down (the connector's ``shutdown``)."""
        if self._builder is not None:
            self._builder.close()
            self._builder = None
        for rid in self.registry.live():
            self.free_request(rid)
        self.registry = LayerRegistry()
        if self._manager is not None:
            self._manager.close()
            self._manager = None
        self._deltas.forget_buffer()  # the next manager's counters start from zero


def pool_reserve_bytes(engine_config: object, config: RetroConfig) -> int:
    """Host address space each layer's page pool is mapped with
    (:mod:`vllm_retro.buffer.host_tier`): twice one attention layer's share of the most the
    host tier can hold, the machine's memory (or ``host_memory_gb`` when larger). Layers
    hold about equal shares (the same tokens, the same KV heads), so no layer's pool grows;
    only address space is taken until pages are written."""
    import psutil

    limit = psutil.virtual_memory().total
    if config.host_memory_gb is not None:
        limit = max(limit, int(config.host_memory_gb * (1 << 30)))
    layers = 1
    model, parallel = (getattr(engine_config, name, None)
                       for name in ("model_config", "parallel_config"))
    if model is not None and parallel is not None:
        try:
            layers = model.get_num_layers_by_block_type(parallel, "attention")
        except (AttributeError, ValueError, TypeError):  # no per-type layer list
            layers = model.get_num_layers(parallel)
    return 2 * limit // max(1, int(layers))


_RUNTIME_ATTRIBUTE = "retro_runtime"
"""Where :func:`engine_runtime` keeps an engine's runtime on its ``KVTransferConfig``."""


def made_runtime(vllm_config: Any) -> RetroRuntime | None:
    """The runtime :func:`engine_runtime` made for the engine ``vllm_config`` configures in
    this process, None when it made none (retro off, or not asked yet); makes nothing."""
    return getattr(getattr(vllm_config, "kv_transfer_config", None), _RUNTIME_ATTRIBUTE, None)


def engine_runtime(vllm_config: Any) -> RetroRuntime | None:
    """The retro runtime of the engine ``vllm_config`` configures, in this process; None when
    retro is off for it (:func:`~vllm_retro.vllm.settings.retro_config`).

    Created on the first call and kept on the engine's ``kv_transfer_config`` (retro's
    connector configuration): the one object vLLM hands, in the engine's ``VllmConfig`` or
    in the copies it makes of it (``with_hf_config``), to everything it builds for the
    engine in a worker: the attention impls at model load, the connector, the metadata
    builders, the worker. So each engine has its own, found from its constructor arguments,
    and the worker's connector frees it at shutdown (:meth:`RetroRuntime.close`).
    """
    runtime = made_runtime(vllm_config)
    if runtime is not None:
        return runtime
    config = retro_config(vllm_config)
    if config is None:
        return None
    runtime = RetroRuntime(vllm_config, config)
    setattr(vllm_config.kv_transfer_config, _RUNTIME_ATTRIBUTE, runtime)
    return runtime


def _no_runtime() -> None:
    """What a pickled :class:`RetroRuntime` loads as."""
    return None
