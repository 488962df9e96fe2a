"""Counters and gauges of the wave buffer, safe to update from the worker thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class BufferStats:
    """Cumulative counters (``_total``-style) and current gauges of one buffer manager."""

    device_cache_hit_clusters: int = 0
    """Retrieval clusters found in the device cluster cache (the device step's)."""
    device_cache_miss_clusters: int = 0
    """Retrieval clusters read from the host tier."""
    hit_tokens: int = 0
    miss_tokens: int = 0
    pages_h2d: int = 0
    """Host pages (cache-page units, partial pages counted whole) read into the execution buffer."""
    host_to_device_bytes: int = 0
    """K+V bytes copied host -> device (misses, prefill offload excluded)."""
    bytes_d2d: int = 0
    """K+V bytes copied device -> device (the steady zone into an execution buffer)."""
    bytes_offloaded: int = 0
    """K+V bytes moved to the host tier at prefill / index updates."""
    updates_submitted: int = 0
    updates_done: int = 0
    update_latency_s: float = 0.0
    """Sum over updates of submit -> done seconds."""
    update_latency_max_s: float = 0.0
    wait_s: float = 0.0
    """Seconds the decode path spent waiting for the worker."""
    queue_depth_max: int = 0
    buffer_update_failures: int = 0
    """Update-worker jobs that failed and were recovered, answers unchanged: a host pool's
    room growth (the next layout grows the pool itself)."""
    device_step_rows: int = 0
    """(request, layer) decode steps served by the device step with the KV copied to the
    device (:mod:`vllm_retro.index.resident`)."""
    device_step_in_place_rows: int = 0
    """(request, layer) decode steps served by the device step reading the KV in place from
    the host tier (over the bus, through the cluster cache when it has one)."""
    host_bytes: int = 0
    """Gauge: host-tier bytes resident (allocated pages)."""
    device_bytes: int = 0
    """Gauge: device bytes resident (execution buffers)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        """Add to counters / gauges atomically, e.g. ``add(device_cache_hit_clusters=3,
        host_bytes=-4096)``."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def record_submit(self) -> None:
        """One update was queued (and the queue's high-water mark is kept)."""
        with self._lock:
            self.updates_submitted += 1
            self.queue_depth_max = max(self.queue_depth_max, self.queue_depth)

    def record_update(self, latency_s: float) -> None:
        """One update finished after ``latency_s`` seconds in the queue and running."""
        with self._lock:
            self.updates_done += 1
            self.update_latency_s += latency_s
            self.update_latency_max_s = max(self.update_latency_max_s, latency_s)

    @property
    def queue_depth(self) -> int:
        """Updates submitted and not yet done."""
        return self.updates_submitted - self.updates_done

    @property
    def hit_ratio(self) -> float:
        """Cluster hits / (hits + misses); 0 before any lookup."""
        total = self.device_cache_hit_clusters + self.device_cache_miss_clusters
        return self.device_cache_hit_clusters / total if total else 0.0

    def snapshot(self) -> dict[str, float]:
        """All counters and gauges plus ``hit_ratio`` and ``queue_depth``, as a plain dict."""
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in fields(self)
                   if not f.name.startswith("_")}
        out["hit_ratio"] = self.hit_ratio
        out["queue_depth"] = self.queue_depth
        return out
