"""A worker's retro counters (:class:`RetroCounters`) and the increments of those exported to
``/metrics`` since the last report (:class:`CounterDeltas`).

An exported counter has one name everywhere: the field here (or in
:class:`~vllm_retro.buffer.stats.BufferStats`), the stats payload's key and the metric
(``vllm_retro:<name>_total``, :data:`vllm_retro.vllm.metrics.FAMILIES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXPORTED = ("indexed_requests", "indexed_tokens", "index_updates", "sparse_decode_tokens",
            "dense_decode_tokens", "index_step_seconds", "dense_fallback_requests",
            "failed_requests")
""":class:`RetroCounters` fields exported as counters."""

BUFFER_EXPORTED = ("device_cache_hit_clusters", "device_cache_miss_clusters",
                   "host_to_device_bytes", "buffer_update_failures",
                   "device_step_rows", "device_step_in_place_rows")
""":class:`~vllm_retro.buffer.stats.BufferStats` fields exported as counters."""


@dataclass
class RetroCounters:
    """Monotonic counters and gauges of one worker process."""

    steps: int = 0
    indexes_built: int = 0
    """(request, layer) indexes built."""
    indexed_requests: int = 0
    retro_decode_tokens: int = 0
    """(token, layer) pairs decoded through the wave index."""
    dense_tokens: int = 0
    """(token, layer) pairs computed by vLLM's dense kernel in retro layers."""
    requests_released: int = 0
    peak_live_requests: int = 0
    peak_decode_rows: int = 0
    """Most requests decoded (dense or retro) in one step."""
    index_build_seconds: float = 0.0
    """Seconds spent building indexes (reading KV back and clustering, all layers), on
    the builder thread or in the step."""
    index_step_seconds: float = 0.0
    """Seconds steps spent on index builds: reading KV back, builds run in the step
    (``build_steps`` 0), waiting at a switch for a build not yet done or for a cancelled
    request's running build."""
    indexed_tokens: int = 0
    """Context tokens of the requests indexed (once per request, not per layer)."""
    index_updates: int = 0
    """(request, layer) update blocks clustered into an index during decoding."""
    sparse_decode_tokens: int = 0
    """Decoded tokens served through the wave index (once per token, not per layer)."""
    dense_decode_tokens: int = 0
    """Decoded tokens of retro layer groups served by vLLM's dense kernel (short requests)."""
    kv_heads: int = 0
    """KV heads per index on this worker (its tensor-parallel share)."""
    dense_fallback_requests: int = 0
    """Requests that decode densely from their paged KV for their whole life because their
    index build failed (:meth:`RetroRuntime.demote`)."""
    failed_requests: int = 0
    """Requests failed with an error to their client because their index broke while
    decoding (:meth:`RetroRuntime.fail_request`)."""


class CounterDeltas:
    """The exported counters' increments between reports (vLLM's connector-stats payload
    carries increments, which it adds up over workers)."""

    def __init__(self) -> None:
        self._reported: dict[str, float] = {}

    def take(self, counters: RetroCounters, buffer: dict[str, Any] | None
             ) -> dict[str, float]:
        """Each exported counter's increment since the previous call: ``counters``' and,
        when given, those of the wave buffer's statistics snapshot ``buffer``."""
        now = {name: getattr(counters, name) for name in EXPORTED}
        if buffer is not None:
            now.update({name: buffer[name] for name in BUFFER_EXPORTED})
        deltas = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return deltas

    def forget_buffer(self) -> None:
        """The wave buffer's statistics restart from zero (a new manager)."""
        self._reported = {k: v for k, v in self._reported.items() if k not in BUFFER_EXPORTED}
