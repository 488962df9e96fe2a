"""Retro's Prometheus metric families on the API server's ``/metrics``, next to vLLM's own.

vLLM builds them through :meth:`RetroConnector.build_prom_metrics` in the API server process
and feeds them every engine step's aggregated :class:`~vllm_retro.vllm.stats.RetroConnectorStats`
(only when stats logging is on, as for vLLM's own families). Every name starts with
:data:`PREFIX`, carries its unit, and counters end in ``_total``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_retro.vllm.stats import BUILD_SECONDS, COUNTERS, GAUGES, combine, lowest_rank

PREFIX = "vllm_retro:"


@dataclass(frozen=True)
class Family:
    """One metric family: its exposed name, type, help text, and the payload key it reads
    (with the value of the ``route`` label for the decode-token counter)."""

    name: str
    kind: str
    """'counter', 'gauge' or 'histogram'."""
    help: str
    key: str
    route: str | None = None


FAMILIES: tuple[Family, ...] = (
    Family(PREFIX + "device_cache_hit_clusters_total", "counter",
           "Retrieval-zone clusters found in the device cluster cache (the GPU decode step "
           "reading the host tier in place), all workers.", "device_cache_hit_clusters"),
    Family(PREFIX + "device_cache_miss_clusters_total", "counter",
           "Retrieval-zone clusters read from the host tier because the device cluster cache "
           "did not hold them (or there is none), all workers.", "device_cache_miss_clusters"),
    Family(PREFIX + "device_cache_hit_ratio", "gauge",
           "Device cluster cache hits / (hits + misses) since the server started (0 before "
           "any lookup).", "hit_ratio"),
    Family(PREFIX + "host_to_device_bytes_total", "counter",
           "K+V bytes copied from the host tier to the device for retrieval-zone misses.",
           "host_to_device_bytes"),
    Family(PREFIX + "device_step_rows_total", "counter",
           "(request, layer) decode steps served by the GPU decode step with the KV on the "
           "device (the context fits the device).", "device_step_rows"),
    Family(PREFIX + "device_step_in_place_rows_total", "counter",
           "(request, layer) decode steps served by the layer's step reading the KV in "
           "place from the host tier (a GPU under memory pressure: pinned; a CPU: every "
           "sparse decode of a batch in the host tier).", "device_step_in_place_rows"),
    Family(PREFIX + "indexed_requests_total", "counter",
           "Requests whose context was indexed (a preempted request indexed again counts "
           "again).", "indexed_requests"),
    Family(PREFIX + "indexed_tokens_total", "counter",
           "Context tokens of the requests indexed (once per request, not per layer).",
           "indexed_tokens"),
    Family(PREFIX + "index_updates_total", "counter",
           "Update blocks of decoded tokens clustered into a wave index, per layer.",
           "index_updates"),
    Family(PREFIX + "decode_tokens_total", "counter",
           "Tokens decoded in full-attention layers, by route: sparse (wave index) or dense "
           "(vLLM's kernel: requests shorter than the indexing threshold).",
           "sparse_decode_tokens", route="sparse"),
    Family(PREFIX + "decode_tokens_total", "counter", "", "dense_decode_tokens", route="dense"),
    Family(PREFIX + "index_build_seconds", "histogram",
           "Seconds one worker spent indexing one request (reading its KV back and clustering "
           "it, all layers), in the background or in the step.", BUILD_SECONDS),
    Family(PREFIX + "index_step_seconds_total", "counter",
           "Seconds engine steps spent on index builds (reading KV back, builds run in the "
           "step, waiting for a cancelled build), all workers: the builds' cost on the "
           "critical path.", "index_step_seconds"),
    Family(PREFIX + "live_requests", "gauge",
           "Requests holding retro state now: wave indexes (built, or being built) and "
           "their wave buffer.", "live_requests"),
    Family(PREFIX + "clusters", "gauge",
           "Clusters in live wave indexes, over layers, KV heads and workers.", "clusters"),
    Family(PREFIX + "host_tier_bytes", "gauge",
           "Host-memory bytes held by live requests (wave buffer host tier and host-side "
           "index data), all workers.", "host_tier_bytes"),
    Family(PREFIX + "device_tier_bytes", "gauge",
           "Device-memory bytes held by retro (device-side index data, "
           "execution buffers), all workers.", "device_tier_bytes"),
    Family(PREFIX + "host_budget_bytes", "gauge",
           "Host memory indexed requests may reserve (--retro-host-memory-gb, or 80% of the "
           "memory available at start-up).", "host_budget_bytes"),
    Family(PREFIX + "host_reserved_bytes", "gauge",
           "Host memory reserved by the requests being indexed or served through their "
           "index (each one's longest possible context, see host_budget).",
           "host_reserved_bytes"),
    Family(PREFIX + "host_budget_waited_requests_total", "counter",
           "Requests that waited in the queue for host memory before they started.",
           "host_budget_waited_requests"),
    Family(PREFIX + "host_budget_dense_requests_total", "counter",
           "Requests decoded densely (from vLLM's paged KV) because indexing them would "
           "need more than the whole host-memory budget.", "host_budget_dense_requests"),
    Family(PREFIX + "dense_fallback_requests_total", "counter",
           "Requests decoded densely (from vLLM's paged KV) for their whole life because "
           "their index build failed (each logged), all workers.", "dense_fallback_requests"),
    Family(PREFIX + "failed_requests_total", "counter",
           "Requests ended with an error to their client because their index broke while "
           "decoding (each logged); no other request is affected, all workers.",
           "failed_requests"),
    Family(PREFIX + "buffer_update_failures_total", "counter",
           "Wave-buffer update-worker jobs that failed and were recovered (each logged; "
           "answers unchanged): a host pool's room growth (the next layout grows the pool "
           "itself), all workers.",
           "buffer_update_failures"),
    Family(PREFIX + "block_cache_hits_total", "counter",
           "Passages of Block-Attention requests loaded from the passage cache instead of "
           "prefilled (--retro-block-cache-gb).", "block_cache_hits"),
    Family(PREFIX + "block_cache_misses_total", "counter",
           "Passages of Block-Attention requests prefilled, none of their tokens loaded: not "
           "cached, after the first passage that was not (loads run from the prompt's first "
           "uncomputed token), or in the recomputed tail (--retro-block-recompute-tokens).",
           "block_cache_misses"),
    Family(PREFIX + "block_cache_loaded_tokens_total", "counter",
           "Prompt tokens loaded from the passage cache (not computed).",
           "block_cache_loaded_tokens"),
    Family(PREFIX + "block_cache_saved_tokens_total", "counter",
           "Passage tokens written into the passage cache.", "block_cache_saved_tokens"),
    Family(PREFIX + "block_cache_evictions_total", "counter",
           "Passages evicted from the passage cache (least recently used) to make room.",
           "block_cache_evictions"),
    Family(PREFIX + "block_cache_rejected_total", "counter",
           "Passages not cached for want of room (larger than the cache, or every page "
           "held by passages being read or written).", "block_cache_rejected"),
    Family(PREFIX + "block_cache_bytes", "gauge",
           "Host memory holding cached passages' KV now, per worker.", "block_cache_bytes"),
    Family(PREFIX + "block_cache_capacity_bytes", "gauge",
           "Host memory the passage cache may hold, per worker (--retro-block-cache-gb).",
           "block_cache_capacity_bytes"),
    Family(PREFIX + "block_cache_passages", "gauge",
           "Passages cached now.", "block_cache_passages"),
)

BUILD_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0)


def family_names() -> list[str]:
    """The distinct exposed family names (counters with their ``_total``)."""
    return list(dict.fromkeys(f.name for f in FAMILIES))


def unregister_retro_metrics() -> None:
    """Drop earlier retro families from prometheus_client's default registry, as vLLM does
    for its own (``unregister_vllm_metrics``, which only matches ``vllm:``), so a second
    engine with stats logging in the same process (offline ``LLM``, tests) can register."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)


class RetroPromMetrics(KVConnectorPromMetrics):
    """Registers :data:`FAMILIES` with vLLM's labels (model name, engine) and records each
    step's payload into them."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        unregister_retro_metrics()
        self._children: dict[tuple[str, str | None], dict[int, Any]] = {}
        made: dict[str, Any] = {}
        for fam in FAMILIES:
            if fam.name not in made:
                made[fam.name] = self._make(fam)
            metric = made[fam.name]
            if fam.route is not None:
                per_engine = {i: metric.labels(*v, fam.route)
                              for i, v in per_engine_labelvalues.items()}
            else:
                per_engine = create_metric_per_engine(metric, per_engine_labelvalues)
            self._children[(fam.key, fam.route)] = per_engine
        self._hits: dict[int, float] = {}
        self._misses: dict[int, float] = {}

    def _make(self, fam: Family) -> Any:
        labels = list(self._labelnames) + (["route"] if fam.route else [])
        if fam.kind == "counter":
            return self._counter_cls(name=fam.name, documentation=fam.help, labelnames=labels)
        if fam.kind == "gauge":
            return self._gauge_cls(name=fam.name, documentation=fam.help, labelnames=labels,
                                   multiprocess_mode="mostrecent")
        return self._histogram_cls(name=fam.name, documentation=fam.help, labelnames=labels,
                                   buckets=list(BUILD_BUCKETS_S))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's payload (see :class:`RetroConnectorStats`) for ``engine_idx``."""
        counters = combine(transfer_stats_data.get(COUNTERS, {}))
        gauges = combine(transfer_stats_data.get(GAUGES, {}))
        for fam in FAMILIES:
            child = self._children[(fam.key, fam.route)][engine_idx]
            if fam.kind == "counter" and counters.get(fam.key):
                child.inc(counters[fam.key])
            elif fam.kind == "gauge" and fam.key in gauges:
                child.set(gauges[fam.key])
        for seconds in lowest_rank(transfer_stats_data.get(BUILD_SECONDS, {})) or ():
            self._children[(BUILD_SECONDS, None)][engine_idx].observe(seconds)
        hits = self._hits.get(engine_idx, 0) + counters.get("device_cache_hit_clusters", 0)
        misses = self._misses.get(engine_idx, 0) + counters.get("device_cache_miss_clusters", 0)
        self._hits[engine_idx], self._misses[engine_idx] = hits, misses
        if hits + misses:
            self._children[("hit_ratio", None)][engine_idx].set(hits / (hits + misses))
