"""Retro's statistics payload, carried from each worker to the API server's ``/metrics``
through vLLM's connector-stats route (``get_kv_connector_stats`` on the worker, aggregated
over workers by vLLM, observed by :class:`~vllm_retro.vllm.metrics.RetroPromMetrics`).

Every value is kept per worker rank. Worker-level quantities (cache hits, bytes, clusters)
add up over ranks; request-level ones (requests and tokens indexed, decode tokens, live
requests, build times) are the same on every rank of a tensor-parallel group (each rank
holds the same requests, a share of the heads), so they are read from one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = "counters"
GAUGES = "gauges"
BUILD_SECONDS = "build_seconds"

REQUEST_LEVEL = frozenset({
    "indexed_requests", "indexed_tokens", "index_updates", "sparse_decode_tokens",
    "dense_decode_tokens", "live_requests",
})
"""Names whose value is identical on every rank (read from the lowest rank)."""


@dataclass
class RetroConnectorStats(KVConnectorStats):
    """``data`` = ``{"counters": {rank: {name: delta}}, "gauges": {rank: {name: value}},
    "build_seconds": {rank: [seconds, ...]}}``; ranks are strings (the payload crosses
    process boundaries as msgpack). Counter deltas add up when aggregated, gauges keep the
    latest value per rank, build times concatenate."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Empty payload."""
        self.data = {COUNTERS: {}, GAUGES: {}, BUILD_SECONDS: {}}

    def aggregate(self, other: KVConnectorStats) -> RetroConnectorStats:
        """Fold ``other`` (another worker's, or a later interval's) into this payload."""
        if other is None or other.is_empty():
            return self
        for rank, values in other.data.get(COUNTERS, {}).items():
            mine = self.data[COUNTERS].setdefault(rank, {})
            for name, v in values.items():
                mine[name] = mine.get(name, 0) + v
        for rank, values in other.data.get(GAUGES, {}).items():
            self.data[GAUGES].setdefault(rank, {}).update(values)
        for rank, obs in other.data.get(BUILD_SECONDS, {}).items():
            self.data[BUILD_SECONDS].setdefault(rank, []).extend(obs)
        return self

    def is_empty(self) -> bool:
        """True when no rank reported anything."""
        return not any(self.data.get(k) for k in (COUNTERS, GAUGES, BUILD_SECONDS))

    def reduce(self) -> dict[str, int | float]:
        """Counters and gauges over all ranks (see module docstring), for vLLM's log line."""
        return {**combine(self.data.get(COUNTERS, {})), **combine(self.data.get(GAUGES, {}))}


def combine(per_rank: dict[str, dict[str, float]]) -> dict[str, float]:
    """One value per name from per-rank values: the sum over ranks, except request-level
    names, read from the lowest rank."""
    out: dict[str, float] = {}
    for rank in sorted(per_rank, key=int):
        for name, v in per_rank[rank].items():
            if name in REQUEST_LEVEL:
                out.setdefault(name, v)
            else:
                out[name] = out.get(name, 0) + v
    return out


def lowest_rank(per_rank: dict[str, Any]) -> Any:
    """The value of the lowest rank of a per-rank mapping (None when empty)."""
    return per_rank[min(per_rank, key=int)] if per_rank else None
