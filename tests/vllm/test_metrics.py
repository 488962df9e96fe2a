"""Retro's Prometheus families: registered through vLLM's ``metric_types`` and labels, fed
the aggregated per-rank payloads vLLM hands to ``observe``, read back from a registry."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from vllm_retro.buffer.stats import BufferStats  # noqa: E402
from vllm_retro.vllm.connector import RetroConnector  # noqa: E402
from vllm_retro.vllm.counters import BUFFER_EXPORTED, EXPORTED, RetroCounters  # noqa: E402
from vllm_retro.vllm.metrics import (  # noqa: E402
    BUILD_BUCKETS_S,
    FAMILIES,
    PREFIX,
    RetroPromMetrics,
    family_names,
)
from vllm_retro.vllm.stats import (  # noqa: E402
    BUILD_SECONDS,
    COUNTERS,
    GAUGES,
    RetroConnectorStats,
)

LABELNAMES = ["model_name", "engine"]
PER_ENGINE = {0: ["m", "0"], 1: ["m", "1"]}
ENGINE0 = {"model_name": "m", "engine": "0"}
ENGINE1 = {"model_name": "m", "engine": "1"}


def _metric_types(reg: CollectorRegistry) -> dict:
    """vLLM's ``metric_types`` mapping, with each class bound to ``reg``."""
    return {cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}


def _retro_vllm_config(**retro: object) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` that retro's settings read, with the retro connector."""
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="RetroConnector"),
                           additional_config={"retro": dict(retro)}, speculative_config=None,
                           cache_config=SimpleNamespace(cache_dtype="auto"))


@pytest.fixture
def reg() -> CollectorRegistry:
    """A fresh registry per test (the default one would reject a second registration)."""
    return CollectorRegistry()


@pytest.fixture
def prom(reg: CollectorRegistry) -> RetroPromMetrics:
    """Retro's families for two engines, registered in ``reg``."""
    return RetroPromMetrics(_retro_vllm_config(), _metric_types(reg), LABELNAMES, PER_ENGINE)


def _step(ranks: dict[int, tuple[dict, dict, list[float]]]) -> dict:
    """The payload vLLM hands to ``observe`` for one step: each rank's (counters, gauges,
    build seconds) as a worker payload, aggregated over ranks, as a plain dict."""
    acc = RetroConnectorStats()
    for rank, (counters, gauges, builds) in ranks.items():
        r = str(rank)
        acc.aggregate(RetroConnectorStats(data={
            COUNTERS: {r: dict(counters)}, GAUGES: {r: dict(gauges)},
            BUILD_SECONDS: {r: list(builds)} if builds else {}}))
    return acc.to_dict()


def _counters(hits: int, misses: int, h2d: int, indexed: int, sparse: int,
              dense: int) -> dict:
    return {"device_cache_hit_clusters": hits, "device_cache_miss_clusters": misses,
            "host_to_device_bytes": h2d, "indexed_requests": indexed,
            "indexed_tokens": 600 * indexed, "index_updates": 1, "sparse_decode_tokens": sparse,
            "dense_decode_tokens": dense}


def _gauges(live: int, clusters: int, host: int, device: int) -> dict:
    return {"live_requests": live, "clusters": clusters, "host_tier_bytes": host,
            "device_tier_bytes": device}


STEP1 = {0: (_counters(3, 1, 100, 1, 5, 2), _gauges(1, 10, 1000, 50), [0.3]),
         1: (_counters(5, 3, 300, 1, 5, 2), _gauges(1, 12, 3000, 70), [0.4])}
STEP2 = {0: (_counters(0, 4, 400, 0, 7, 0), _gauges(2, 20, 2000, 60), [0.5]),
         1: (_counters(2, 2, 200, 0, 7, 0), _gauges(2, 22, 4000, 80), [0.6])}


def _value(reg: CollectorRegistry, name: str, labels: dict, **extra: str) -> float | None:
    return reg.get_sample_value(PREFIX + name, {**labels, **extra})


def test_observe_two_steps_two_ranks(reg: CollectorRegistry, prom: RetroPromMetrics) -> None:
    """Two steps of two ranks' payloads for engine 0: worker-level counters add up over
    ranks and steps, request-level ones count once per step (not once per rank), gauges
    show the latest step's value combined over ranks, the build-time histogram sees the
    lowest rank's observations only, the hit ratio is cumulative, decode tokens are split
    by route, and engine 1 stays at zero."""
    prom.observe(_step(STEP1), engine_idx=0)
    assert _value(reg, "device_cache_hit_ratio", ENGINE0) == pytest.approx(8 / 12)
    assert _value(reg, "live_requests", ENGINE0) == 1
    prom.observe(_step(STEP2), engine_idx=0)

    v = functools.partial(_value, reg)
    assert v("device_cache_hit_clusters_total", ENGINE0) == 3 + 5 + 0 + 2
    assert v("device_cache_miss_clusters_total", ENGINE0) == 1 + 3 + 4 + 2
    assert v("host_to_device_bytes_total", ENGINE0) == 100 + 300 + 400 + 200
    assert v("indexed_requests_total", ENGINE0) == 1
    assert v("indexed_tokens_total", ENGINE0) == 600
    assert v("index_updates_total", ENGINE0) == 2
    assert v("decode_tokens_total", ENGINE0, route="sparse") == 5 + 7
    assert v("decode_tokens_total", ENGINE0, route="dense") == 2
    assert v("device_cache_hit_ratio", ENGINE0) == pytest.approx(10 / 20)
    assert v("live_requests", ENGINE0) == 2
    assert v("clusters", ENGINE0) == 20 + 22
    assert v("host_tier_bytes", ENGINE0) == 2000 + 4000
    assert v("device_tier_bytes", ENGINE0) == 60 + 80
    assert v("index_build_seconds_count", ENGINE0) == 2
    assert v("index_build_seconds_sum", ENGINE0) == pytest.approx(0.3 + 0.5)
    assert v("index_build_seconds_bucket", ENGINE0, le="0.25") == 0
    assert v("index_build_seconds_bucket", ENGINE0, le="0.5") == 2

    assert v("device_cache_hit_clusters_total", ENGINE1) == 0
    assert v("decode_tokens_total", ENGINE1, route="sparse") == 0
    assert v("live_requests", ENGINE1) == 0
    assert v("device_cache_hit_ratio", ENGINE1) == 0
    assert v("index_build_seconds_count", ENGINE1) == 0


def test_hit_ratio_per_engine_and_unset_without_lookups(reg: CollectorRegistry,
                                                        prom: RetroPromMetrics) -> None:
    """The hit ratio stays 0 while an engine has made no lookup (no division by zero), and
    each engine's ratio is computed from its own cumulative hits and misses."""
    quiet = {0: (_counters(0, 0, 0, 0, 0, 3), _gauges(0, 0, 0, 0), [])}
    prom.observe(_step(quiet), engine_idx=1)
    assert _value(reg, "device_cache_hit_ratio", ENGINE1) == 0
    assert _value(reg, "decode_tokens_total", ENGINE1, route="dense") == 3
    prom.observe(_step({0: (_counters(1, 3, 0, 0, 1, 0), _gauges(1, 1, 1, 1), [])}), 1)
    prom.observe(_step({0: (_counters(9, 0, 0, 0, 1, 0), _gauges(1, 1, 1, 1), [])}), 0)
    assert _value(reg, "device_cache_hit_ratio", ENGINE1) == pytest.approx(0.25)
    assert _value(reg, "device_cache_hit_ratio", ENGINE0) == pytest.approx(1.0)


def test_observe_accepts_an_empty_payload(reg: CollectorRegistry,
                                          prom: RetroPromMetrics) -> None:
    """An empty payload (a step where no worker reported) records nothing."""
    prom.observe(RetroConnectorStats().to_dict(), engine_idx=0)
    prom.observe({}, engine_idx=0)
    assert _value(reg, "device_cache_hit_clusters_total", ENGINE0) == 0
    assert _value(reg, "index_build_seconds_count", ENGINE0) == 0


def test_family_names_types_help_and_units(reg: CollectorRegistry,
                                           prom: RetroPromMetrics) -> None:
    """Every family is registered under the retro prefix with a help text; counters end in
    ``_total`` and nothing else does; names reading bytes or seconds carry that unit; the
    histogram uses the build-time buckets."""
    collected = {m.name: m for m in reg.collect()}
    exposed = {name.removesuffix("_total") for name in family_names()}
    assert set(collected) == exposed
    for fam in FAMILIES:
        assert fam.name.startswith(PREFIX)
        assert fam.kind in ("counter", "gauge", "histogram")
        assert fam.name.endswith("_total") == (fam.kind == "counter"), fam.name
        for unit in ("bytes", "seconds"):
            if unit in fam.key:
                assert f"_{unit}" in fam.name, fam.name
        metric = collected[fam.name.removesuffix("_total")]
        assert metric.type == fam.kind
        assert metric.documentation.strip(), fam.name
        labels = {s.labels.get("route") for s in metric.samples}
        assert labels == ({"sparse", "dense"} if fam.route else {None}), fam.name
    hist = collected[PREFIX + "index_build_seconds"]
    bounds = sorted({s.labels["le"] for s in hist.samples if s.name.endswith("_bucket")},
                    key=float)
    assert [float(b) for b in bounds] == [*BUILD_BUCKETS_S, float("inf")]


def test_every_exported_counter_has_one_name() -> None:
    """A counter a worker keeps (:class:`RetroCounters`, the wave buffer's
    :class:`BufferStats`) goes out under its own field name: the payload key, and the metric
    ``vllm_retro:<name>_total`` (the decode-token route counters share one labelled
    metric)."""
    fields = {f.name for cls in (RetroCounters, BufferStats) for f in dataclasses.fields(cls)}
    exported = set(EXPORTED) | set(BUFFER_EXPORTED)
    assert exported <= fields
    counters = {fam.key: fam for fam in FAMILIES if fam.kind == "counter"}
    assert exported <= set(counters)
    for key in exported:
        fam = counters[key]
        if fam.route is None:
            assert fam.name == f"{PREFIX}{key}_total", (key, fam.name)
        else:
            assert key == f"{fam.route}_{fam.name.removeprefix(PREFIX).removesuffix('_total')}"


def test_build_prom_metrics_only_with_retro() -> None:
    """The connector builds retro's families when the retro connector is configured, and
    none for an engine without retro or with retro disabled."""
    reg = CollectorRegistry()
    stock = SimpleNamespace(additional_config={}, kv_transfer_config=None)
    assert RetroConnector.build_prom_metrics(stock, _metric_types(reg), LABELNAMES,
                                             PER_ENGINE) is None
    off = _retro_vllm_config(enabled=False)
    assert RetroConnector.build_prom_metrics(off, _metric_types(reg), LABELNAMES,
                                             PER_ENGINE) is None
    assert list(reg.collect()) == []
    prom = RetroConnector.build_prom_metrics(_retro_vllm_config(retrieval_budget=0.05),
                                             _metric_types(reg), LABELNAMES, PER_ENGINE)
    assert isinstance(prom, RetroPromMetrics)
    assert reg.get_sample_value(PREFIX + "live_requests", ENGINE1) == 0


def test_second_engine_in_one_process_registers_again() -> None:
    """Two engines with stats logging in one process (offline ``LLM``s one after the other)
    both register retro's families in prometheus_client's default registry, as vLLM's own
    families do; the newer one's are exposed."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from vllm_retro.vllm.metrics import RetroPromMetrics, unregister_retro_metrics

    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    cfg = SimpleNamespace(kv_transfer_config=None)
    try:
        RetroPromMetrics(cfg, types, ["model_name", "engine"], {0: ["a", "0"]})
        second = RetroPromMetrics(cfg, types, ["model_name", "engine"], {0: ["b", "0"]})
        second.observe({"counters": {"0": {"indexed_requests": 2}}}, 0)
        assert REGISTRY.get_sample_value("vllm_retro:indexed_requests_total",
                                         {"model_name": "b", "engine": "0"}) == 2
        assert REGISTRY.get_sample_value("vllm_retro:indexed_requests_total",
                                         {"model_name": "a", "engine": "0"}) is None
    finally:
        unregister_retro_metrics()
