"""Retro's connector-stats payload: aggregation over workers and steps as vLLM does it
(``KVOutputAggregator`` over tensor-parallel workers, ``KVConnectorLogging`` over steps),
the msgpack trip between processes, and what a real :class:`RetroRuntime` reports."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.vllm.connector import RetroConnector  # noqa: E402
from vllm_retro.vllm.runtime import RetroRuntime  # noqa: E402
from vllm_retro.vllm.stats import (  # noqa: E402
    BUILD_SECONDS,
    COUNTERS,
    GAUGES,
    REQUEST_LEVEL,
    RetroConnectorStats,
    combine,
    lowest_rank,
)


def _worker(rank: int, hits: int, h2d: int, live: int, host: int,
            builds: list[float] | None = None, sparse: int = 5,
            indexed: int = 1) -> RetroConnectorStats:
    """One worker's payload for one step, shaped like ``RetroRuntime.take_stats``'s."""
    r = str(rank)
    return RetroConnectorStats(data={
        COUNTERS: {r: {"device_cache_hit_clusters": hits, "host_to_device_bytes": h2d,
                       "indexed_requests": indexed, "sparse_decode_tokens": sparse}},
        GAUGES: {r: {"live_requests": live, "host_tier_bytes": host}},
        BUILD_SECONDS: {r: list(builds)} if builds else {},
    })


def _tp_step(**per_rank: dict) -> RetroConnectorStats:
    """Aggregate several workers' payloads the way ``KVOutputAggregator`` does: the first
    worker's object is the accumulator, the others are folded into it in rank order."""
    stats = [_worker(int(rank[1:]), **kw) for rank, kw in sorted(per_rank.items())]
    acc = stats[0]
    for other in stats[1:]:
        acc = acc.aggregate(other)
    return acc


def test_fresh_payload_is_empty_and_reset_empties() -> None:
    """A fresh object (no data) is empty and holds the three sections; so is one rebuilt
    from no payload; a payload with data is not empty, and reset() empties it again."""
    fresh = RetroConnectorStats()
    assert fresh.is_empty()
    assert fresh.data == {COUNTERS: {}, GAUGES: {}, BUILD_SECONDS: {}}
    assert fresh.reduce() == {}
    full = _worker(0, hits=1, h2d=2, live=1, host=3)
    assert not full.is_empty()
    full.reset()
    assert full.is_empty()
    assert RetroConnector.build_kv_connector_stats(None).is_empty()
    assert RetroConnector.build_kv_connector_stats({}).is_empty()


def test_two_ranks_sum_worker_level_and_read_request_level_once() -> None:
    """Two TP workers' payloads aggregated: worker-level counters and gauges (cache hits,
    host-to-device bytes, host-tier bytes) add up over ranks, request-level ones (indexed
    requests, sparse decode tokens, live requests) are taken from the lowest rank rather
    than doubled, and each rank's build times are kept under its own rank."""
    acc = _tp_step(r0=dict(hits=3, h2d=100, live=2, host=1000, builds=[0.5]),
                   r1=dict(hits=4, h2d=300, live=2, host=3000, builds=[0.25]))
    assert set(acc.data[COUNTERS]) == {"0", "1"}
    assert acc.data[BUILD_SECONDS] == {"0": [0.5], "1": [0.25]}
    reduced = acc.reduce()
    assert reduced == {"device_cache_hit_clusters": 7, "host_to_device_bytes": 400,
                       "indexed_requests": 1, "sparse_decode_tokens": 5,
                       "live_requests": 2, "host_tier_bytes": 4000}
    assert {"indexed_requests", "sparse_decode_tokens", "live_requests"} <= REQUEST_LEVEL
    assert not ({"device_cache_hit_clusters", "host_to_device_bytes", "host_tier_bytes"}
                & REQUEST_LEVEL)


def test_request_level_read_from_lowest_rank_whatever_the_order() -> None:
    """Request-level names come from the numerically lowest rank even when a higher rank
    was aggregated first and ranks sort differently as strings ('10' < '2')."""
    acc = _worker(10, hits=1, h2d=1, live=7, host=1, indexed=9)
    acc = acc.aggregate(_worker(2, hits=1, h2d=1, live=3, host=1, indexed=4))
    reduced = acc.reduce()
    assert reduced["live_requests"] == 3
    assert reduced["indexed_requests"] == 4
    assert reduced["device_cache_hit_clusters"] == 2
    assert lowest_rank({"10": "ten", "2": "two"}) == "two"
    assert lowest_rank({}) is None
    assert combine({}) == {}


def test_aggregation_over_steps_sums_counters_keeps_latest_gauges() -> None:
    """Accumulated over steps (as vLLM's logging interval does): counter deltas add up per
    rank, gauges keep each rank's latest value, build times concatenate per rank; reduce()
    then combines the ranks as for a single step."""
    step1 = _tp_step(r0=dict(hits=3, h2d=100, live=2, host=1000, builds=[0.5]),
                     r1=dict(hits=4, h2d=300, live=2, host=3000, builds=[0.25]))
    step2 = _tp_step(r0=dict(hits=1, h2d=10, live=1, host=500, builds=[1.5]),
                     r1=dict(hits=2, h2d=30, live=1, host=700))
    acc = step1.aggregate(step2)
    assert acc is step1
    assert acc.data[COUNTERS]["0"]["device_cache_hit_clusters"] == 4
    assert acc.data[COUNTERS]["1"]["host_to_device_bytes"] == 330
    assert acc.data[COUNTERS]["0"]["indexed_requests"] == 2
    assert acc.data[GAUGES] == {"0": {"live_requests": 1, "host_tier_bytes": 500},
                                "1": {"live_requests": 1, "host_tier_bytes": 700}}
    assert acc.data[BUILD_SECONDS] == {"0": [0.5, 1.5], "1": [0.25]}
    assert acc.reduce() == {"device_cache_hit_clusters": 10, "host_to_device_bytes": 440,
                            "indexed_requests": 2, "sparse_decode_tokens": 10,
                            "live_requests": 1, "host_tier_bytes": 1200}


def test_aggregate_ignores_empty_and_none_and_does_not_alias_other() -> None:
    """Folding in None or an empty payload changes nothing; folding in another payload
    copies its values, so later aggregation into the accumulator leaves it untouched."""
    acc = _worker(0, hits=1, h2d=2, live=1, host=3, builds=[0.1])
    before = acc.reduce()
    assert acc.aggregate(None) is acc
    assert acc.aggregate(RetroConnectorStats()) is acc
    assert acc.reduce() == before
    other = _worker(1, hits=5, h2d=5, live=1, host=5, builds=[0.2])
    acc.aggregate(other)
    acc.aggregate(_worker(1, hits=1, h2d=1, live=9, host=9, builds=[0.3]))
    assert other.data[COUNTERS]["1"]["device_cache_hit_clusters"] == 5
    assert other.data[GAUGES]["1"] == {"live_requests": 1, "host_tier_bytes": 5}
    assert other.data[BUILD_SECONDS]["1"] == [0.2]


def test_payload_survives_msgpack_round_trip() -> None:
    """vLLM ships the payload from the engine core to the API server as msgpack: the
    decoded dict, rebuilt by ``build_kv_connector_stats``, equals the original (string
    ranks stay map keys) and keeps aggregating."""
    msgpack = pytest.importorskip("msgspec.msgpack")
    acc = _tp_step(r0=dict(hits=3, h2d=100, live=2, host=1000, builds=[0.5]),
                   r1=dict(hits=4, h2d=300, live=2, host=3000, builds=[0.25]))
    wire = msgpack.decode(msgpack.encode(acc.to_dict()))
    rebuilt = RetroConnector.build_kv_connector_stats(wire)
    assert isinstance(rebuilt, RetroConnectorStats)
    assert rebuilt.data == acc.data
    assert rebuilt.reduce() == acc.reduce()
    rebuilt.aggregate(_worker(1, hits=1, h2d=0, live=0, host=0))
    assert rebuilt.reduce()["device_cache_hit_clusters"] == 8


# ---------------------------------------------------------------------- a real runtime

@pytest.fixture
def runtime():
    """A retro runtime of a stand-in engine with small update blocks; closed after."""
    cfg = RetroConfig(update_segment=64, update_clusters=8, async_updates=False,
                      kernel_backend="torch")
    rt = RetroRuntime(object(), cfg)
    yield rt
    rt.close()


def test_runtime_take_stats_deltas_gauges_and_release(runtime: RetroRuntime,
                                                      rng: torch.Generator) -> None:
    """take_stats on a real runtime: the first call reports the indexed request, its tokens
    and build time plus live gauges; the next reports zero deltas, no build times and the
    same gauges; decoding through the index moves the cache hit/miss counters; after the
    request is freed the live gauges drop to zero."""
    h, n, d = 2, 600, 32
    keys = torch.randn(h, n, d, generator=rng)
    values = torch.randn(h, n, d, generator=rng)
    index = runtime.build_index("r1", "layer0", keys, values)
    runtime.note_build_time("r1", 0.5)

    first = runtime.take_stats(0).data
    assert set(first[COUNTERS]) == {"0"}
    c, g = first[COUNTERS]["0"], first[GAUGES]["0"]
    assert c["indexed_requests"] == 1
    assert c["indexed_tokens"] == n
    assert g["live_requests"] == 1
    assert g["clusters"] == index.num_clusters * h > 0
    assert g["host_tier_bytes"] > 0
    assert first[BUILD_SECONDS] == {"0": [0.5]}

    second = runtime.take_stats(0).data
    assert second[COUNTERS]["0"] and not any(second[COUNTERS]["0"].values())
    assert second[BUILD_SECONDS] == {}
    assert second[GAUGES] == first[GAUGES]

    # Decode as the retro route does: append the new token, decode one query (4 heads).
    updates = 0
    for _ in range(runtime.config.update_segment + 4):
        if index.append(torch.randn(h, 1, d, generator=rng), torch.randn(h, 1, d, generator=rng)):
            updates += 1
            runtime.counters.index_updates += 1
        index.decode(torch.randn(2 * h, d, generator=rng))
    assert updates == 1
    third = runtime.take_stats(3).data
    c3, g3 = third[COUNTERS]["3"], third[GAUGES]["3"]
    assert c3["device_cache_hit_clusters"] + c3["device_cache_miss_clusters"] > 0
    assert c3["device_cache_miss_clusters"] > 0 and c3["host_to_device_bytes"] > 0
    assert c3["index_updates"] == 1
    assert c3["indexed_requests"] == 0
    assert g3["clusters"] == index.num_clusters * h > g["clusters"]
    assert g3["live_requests"] == 1

    assert runtime.free_request("r1")
    freed = runtime.take_stats(0).data[GAUGES]["0"]
    assert freed["live_requests"] == 0
    assert freed["host_tier_bytes"] == 0
    assert freed["clusters"] == 0
    # Only the shared execution buffers stay on the device side.
    assert freed["device_tier_bytes"] == runtime.manager.exec_nbytes()


def test_runtime_hits_plus_misses_count_every_retrieval_lookup(runtime: RetroRuntime,
                                                                rng: torch.Generator) -> None:
    """Every decode step looks up ``num_retrieval`` clusters per KV head; the hit and miss
    deltas reported by take_stats add up to exactly that many lookups."""
    h, d = 2, 32
    index = runtime.build_index("r1", "layer0", torch.randn(h, 600, d, generator=rng),
                                torch.randn(h, 600, d, generator=rng))
    runtime.take_stats(0)
    lookups = 0
    for _ in range(10):
        lookups += h * runtime.config.num_retrieval(index.num_clusters)
        index.append(torch.randn(h, 1, d, generator=rng), torch.randn(h, 1, d, generator=rng))
        index.decode(torch.randn(2 * h, d, generator=rng))
    c = runtime.take_stats(0).data[COUNTERS]["0"]
    assert c["device_cache_hit_clusters"] + c["device_cache_miss_clusters"] == lookups
