"""Generate ``deploy/grafana/dashboards/vllm-retro.json``, the Grafana dashboard for vllm-retro.

The dashboard is written by this script rather than edited by hand so that panel ids, grid
positions and the per-panel datasource stay consistent. Edit the panel list below and run::

    python deploy/grafana/make_dashboard.py

``tests/deploy/test_deploy.py`` checks that the committed JSON is what this script writes and
that every ``vllm_retro:`` / ``vllm:`` series it queries exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "vllm-retro.json"

DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
"""Every panel and target reads the templated Prometheus datasource variable."""

SEL = '{model_name=~"$model_name"}'
"""Label selector applied to every series: the dashboard's ``model_name`` variable."""

RATE = "[$__rate_interval]"


def rate(series: str, by: str = "") -> str:
    """``sum [by (...)] (rate(series{model}[interval]))``."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({series}{SEL}{RATE}))"


def quantile(q: float, histogram: str) -> str:
    """The ``q`` quantile of a histogram family over the rate interval, all engines merged."""
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{SEL}{RATE})))"


def total(series: str) -> str:
    """A gauge summed over engines (data-parallel ranks) of the selected models."""
    return f"sum({series}{SEL})"


@dataclass
class Panel:
    """One dashboard panel: title, unit, PromQL targets as (expr, legend), optional help."""

    title: str
    unit: str
    targets: list[tuple[str, str]]
    description: str = ""
    kind: str = "timeseries"
    width: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    """A row header grouping the panels that follow it."""

    title: str
    panels: list[Panel]


ROWS: list[Row] = [
    Row("Requests and tokens (vLLM)", [
        Panel("Request throughput", "reqps",
              [(rate("vllm:request_success_total", "finished_reason"), "{{finished_reason}}")],
              "Finished requests per second, by finish reason."),
        Panel("Token throughput", "short",
              [(rate("vllm:prompt_tokens_total"), "prompt tokens/s"),
               (rate("vllm:generation_tokens_total"), "generation tokens/s")],
              "Prefill (prompt) and decode (generation) tokens processed per second."),
        Panel("Running / waiting requests", "short",
              [(total("vllm:num_requests_running"), "running"),
               (total("vllm:num_requests_waiting"), "waiting")],
              "Requests in the engine's running batch and in its waiting queue."),
        Panel("KV-cache usage (paged blocks)", "percentunit",
              [(f"max(vllm:kv_cache_usage_perc{SEL})", "used")],
              "Fraction of vLLM's paged KV blocks in use. Indexed requests give their paged "
              "blocks back once their KV moves to the wave buffer.", width=24),
    ]),
    Row("Latency (vLLM)", [
        Panel("Time to first token", "s",
              [(quantile(0.5, "vllm:time_to_first_token_seconds"), "p50"),
               (quantile(0.95, "vllm:time_to_first_token_seconds"), "p95")],
              "TTFT quantiles. Includes building the wave index for long prompts."),
        Panel("Inter-token latency", "s",
              [(quantile(0.5, "vllm:inter_token_latency_seconds"), "p50"),
               (quantile(0.95, "vllm:inter_token_latency_seconds"), "p95")],
              "Time between consecutive output tokens of a request."),
        Panel("End-to-end request latency", "s",
              [(quantile(0.5, "vllm:e2e_request_latency_seconds"), "p50"),
               (quantile(0.95, "vllm:e2e_request_latency_seconds"), "p95")],
              "From arrival to the last token."),
    ]),
    Row("Retro: device cluster cache (GPU decode step)", [
        Panel("Device cache hit ratio", "percentunit",
              [(f"avg(vllm_retro:device_cache_hit_ratio{SEL})", "since start"),
               (f"{rate('vllm_retro:device_cache_hit_clusters_total')} / ("
                f"{rate('vllm_retro:device_cache_hit_clusters_total')} + "
                f"{rate('vllm_retro:device_cache_miss_clusters_total')})", "over the interval")],
              "Retrieval-zone clusters found in the device cluster cache / all looked up (the GPU "
              "decode step reading the host tier in place; 0 on a CPU).",
              extra={"min": 0, "max": 1}),
        Panel("Cache hits vs misses", "short",
              [(rate("vllm_retro:device_cache_hit_clusters_total"), "hit clusters/s"),
               (rate("vllm_retro:device_cache_miss_clusters_total"), "miss clusters/s")],
              "Retrieval-zone cluster lookups per second, all workers."),
        Panel("Host to device traffic", "Bps",
              [(rate("vllm_retro:host_to_device_bytes_total"), "host -> device")],
              "K+V bytes per second read from the host tier for cluster-cache misses."),
        Panel("GPU decode step", "short",
              [(rate("vllm_retro:device_step_rows_total"), "KV on the device"),
               (rate("vllm_retro:device_step_in_place_rows_total"), "KV read in place")],
              "(request, layer) decode steps per second served by the GPU decode step: the "
              "KV copied to the device, or read in place from the pinned host tier under "
              "memory pressure (0 on a CPU)."),
    ]),
    Row("Retro: memory and live state", [
        Panel("Live indexed requests", "short",
              [(total("vllm_retro:live_requests"), "live requests")],
              "Requests holding a wave index and wave buffer now."),
        Panel("Clusters", "short",
              [(total("vllm_retro:clusters"), "clusters")],
              "Clusters in live wave indexes, over layers, KV heads and workers."),
        Panel("Host tier / device tier bytes", "bytes",
              [(total("vllm_retro:host_tier_bytes"), "host tier"),
               (total("vllm_retro:device_tier_bytes"), "device tier")],
              "Host memory held by live requests' KV and index data; device memory held by "
              "retro's block caches, device-side index data and buffers."),
        Panel("Host-memory budget", "bytes",
              [(total("vllm_retro:host_budget_bytes"), "budget"),
               (total("vllm_retro:host_reserved_bytes"), "reserved")],
              "Host memory indexed requests may reserve, and what they reserve now."),
        Panel("Requests waiting for host memory", "reqps",
              [(rate("vllm_retro:host_budget_waited_requests_total"), "waited/s"),
               (rate("vllm_retro:host_budget_dense_requests_total"), "dense (too large)/s")],
              "Requests that waited in the queue for host memory; requests too large for "
              "the whole budget, decoded densely."),
    ]),
    Row("Retro: wave index", [
        Panel("Indexed requests", "reqps",
              [(rate("vllm_retro:indexed_requests_total"), "indexed requests/s")],
              "Requests whose context was indexed per second."),
        Panel("Indexed tokens", "short",
              [(rate("vllm_retro:indexed_tokens_total"), "indexed tokens/s")],
              "Context tokens indexed per second."),
        Panel("Index updates", "short",
              [(rate("vllm_retro:index_updates_total"), "updates/s")],
              "Update blocks of decoded tokens clustered into a wave index per second."),
        Panel("Index build time", "s",
              [(quantile(0.5, "vllm_retro:index_build_seconds"), "p50"),
               (quantile(0.95, "vllm_retro:index_build_seconds"), "p95")],
              "Seconds one worker spends indexing one request (all layers)."),
        Panel("Index work in steps", "percentunit",
              [(rate("vllm_retro:index_step_seconds_total"), "share of wall time")],
              "Share of wall time engine steps spend on index builds (reading KV back; "
              "builds themselves run on a background thread unless background_build is "
              "off)."),
        Panel("Decode tokens: sparse vs dense", "short",
              [(rate("vllm_retro:decode_tokens_total", "route"), "{{route}}")],
              "Tokens decoded per second in full-attention layers through the wave index "
              "(sparse) or vLLM's kernel (dense: requests below the indexing threshold).",
              width=16, extra={"stacking": "normal"}),
    ]),
    Row("Retro: Block-Attention passage cache", [
        Panel("Passages loaded vs prefilled", "short",
              [(rate("vllm_retro:block_cache_hits_total"), "loaded (hits)/s"),
               (rate("vllm_retro:block_cache_misses_total"), "prefilled (misses)/s")],
              "Passages of Block-Attention requests loaded from the passage cache at their "
              "new positions, and passages prefilled."),
        Panel("Passage tokens", "short",
              [(rate("vllm_retro:block_cache_loaded_tokens_total"), "loaded/s"),
               (rate("vllm_retro:block_cache_saved_tokens_total"), "saved/s")],
              "Prompt tokens loaded instead of computed; passage tokens written into the "
              "cache."),
        Panel("Passage cache size", "bytes",
              [(total("vllm_retro:block_cache_bytes"), "held"),
               (total("vllm_retro:block_cache_capacity_bytes"), "capacity")],
              "Host memory holding cached passages' KV, and what the cache may hold "
              "(--retro-block-cache-gb)."),
        Panel("Passages cached, evicted, rejected", "short",
              [(total("vllm_retro:block_cache_passages"), "cached"),
               (rate("vllm_retro:block_cache_evictions_total"), "evicted/s"),
               (rate("vllm_retro:block_cache_rejected_total"), "rejected/s")],
              "Passages in the cache; least recently used ones evicted for room; passages "
              "not cached for want of room."),
    ]),
    Row("Retro: failures (each logged, confined to its request)", [
        Panel("Failed and dense-fallback requests", "reqps",
              [(rate("vllm_retro:failed_requests_total"), "failed (error to client)/s"),
               (rate("vllm_retro:dense_fallback_requests_total"), "build failed, dense/s")],
              "Requests ended with an error because their index broke while decoding; "
              "requests decoded densely for life because their index build failed."),
        Panel("Wave-buffer update failures", "short",
              [(rate("vllm_retro:buffer_update_failures_total"), "recovered failures/s")],
              "Update-worker jobs that failed and were recovered (a device cache dropped "
              "and refilled, a host pool grown later); answers unchanged."),
    ]),
]


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if "stacking" in panel.extra:
        custom["stacking"] = {"mode": panel.extra["stacking"], "group": "A"}
    defaults: dict[str, Any] = {"unit": panel.unit, "custom": custom}
    for key in ("min", "max"):
        if key in panel.extra:
            defaults[key] = panel.extra[key]
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": dict(DS),
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": [
            {"datasource": dict(DS), "expr": expr, "legendFormat": legend, "range": True,
             "refId": chr(ord("A") + i)}
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def build() -> dict[str, Any]:
    """The dashboard as a JSON-ready dict."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x = pid + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel_json(panel, pid, x, y))
            pid, x = pid + 1, x + panel.width
        y += 8
    return {
        "annotations": {"list": []},
        "description": "vLLM serving with RetroInfer (wave index + wave buffer): vLLM's request "
                       "metrics and retro's vllm_retro:* families.",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["vllm", "vllm-retro", "llm"],
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
             "options": []},
            {"name": "model_name", "label": "Model", "type": "query", "datasource": dict(DS),
             "query": {"query": "label_values(vllm:num_requests_running, model_name)",
                       "refId": "model_name"},
             "definition": "label_values(vllm:num_requests_running, model_name)",
             "current": {}, "hide": 0, "includeAll": True, "allValue": ".*", "multi": True,
             "refresh": 2, "sort": 1, "regex": "", "options": []},
        ]},
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "vLLM Retro",
        "uid": "vllm-retro",
        "version": 1,
    }


def render() -> str:
    """The dashboard file's exact text."""
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
