"""Prometheus text from ``/metrics``: parse it, take before/after deltas, and summarise vLLM's
latency histograms and token counters plus retro's ``vllm_retro:*`` families for a load run.

Used by :mod:`bench.serve_load`; it needs no vLLM, only the exposition text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

_LINE = re.compile(r"^([^\s{#]+)(\{[^}]*\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

HISTOGRAMS = {
    "ttft_s": "vllm:time_to_first_token_seconds",
    "itl_s": "vllm:inter_token_latency_seconds",
    "e2e_s": "vllm:e2e_request_latency_seconds",
}
"""Server latency histograms reported, by the key used in the report."""

QUANTILES = (0.5, 0.9, 0.99)


def parse(text: str) -> Samples:
    """Every sample of a Prometheus exposition text, keyed by (name, sorted labels)."""
    out: Samples = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0.0 if none)."""
    total = 0.0
    for (n, lab), v in samples.items():
        if n == name and all(dict(lab).get(k) == want for k, want in labels.items()):
            total += v
    return total


def delta(before: Samples, after: Samples) -> Samples:
    """``after - before`` per sample (samples missing before count as 0)."""
    return {key: v - before.get(key, 0.0) for key, v in after.items()}


def buckets(samples: Samples, family: str) -> list[tuple[float, float]]:
    """The cumulative buckets ``(upper bound, count)`` of histogram ``family``, summed over
    every other label, sorted by bound (the last bound is ``inf``)."""
    by_le: dict[float, float] = {}
    for (n, lab), v in samples.items():
        if n != family + "_bucket":
            continue
        le = float(dict(lab)["le"].replace("+Inf", "inf"))
        by_le[le] = by_le.get(le, 0.0) + v
    return sorted(by_le.items())


def bucket_quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """Quantile ``q`` (0..1) of a cumulative histogram, interpolated linearly inside the bucket
    that holds it (Prometheus's ``histogram_quantile``); NaN when the histogram is empty. A
    quantile in the ``+Inf`` bucket is reported as the highest finite bound."""
    if not cumulative or cumulative[-1][1] <= 0:
        return math.nan
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def histogram_summary(samples: Samples, family: str) -> dict[str, float]:
    """Count, mean (``_sum / _count``, seconds) and bucket-interpolated p50/p90/p99 of one
    histogram in ``samples`` (normally a before/after delta)."""
    count = value(samples, family + "_count")
    total = value(samples, family + "_sum")
    cumulative = buckets(samples, family)
    out = {"count": count, "mean": total / count if count else math.nan}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = bucket_quantile(q, cumulative)
    return out


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def retro_summary(d: Samples) -> dict[str, float]:
    """The retro families over a run (``d``: a before/after delta): indexed requests and
    tokens, sparse and dense decode tokens, the device cache hit ratio of the run's lookups
    (the device step's cluster cache; a step whose clusters are gathered from the host tier
    counts them as misses), host-to-device bytes and the mean index build time (seconds)."""
    p = "vllm_retro:"
    hits = value(d, p + "device_cache_hit_clusters_total")
    misses = value(d, p + "device_cache_miss_clusters_total")
    builds = value(d, p + "index_build_seconds_count")
    return {
        "indexed_requests": value(d, p + "indexed_requests_total"),
        "indexed_tokens": value(d, p + "indexed_tokens_total"),
        "index_updates": value(d, p + "index_updates_total"),
        "sparse_decode_tokens": value(d, p + "decode_tokens_total", route="sparse"),
        "dense_decode_tokens": value(d, p + "decode_tokens_total", route="dense"),
        "device_cache_hit_clusters": hits,
        "device_cache_miss_clusters": misses,
        "cache_hit_ratio": _ratio(hits, hits + misses),
        "host_to_device_bytes": value(d, p + "host_to_device_bytes_total"),
        "index_builds": builds,
        "index_build_mean_s": _ratio(value(d, p + "index_build_seconds_sum"), builds),
    }


def server_summary(before: Samples, after: Samples) -> dict[str, object]:
    """The server's own account of a run: token and request counters, the latency histograms
    (see :func:`histogram_summary`) and :func:`retro_summary`, all as after-minus-before."""
    d = delta(before, after)
    return {
        "requests_succeeded": value(d, "vllm:request_success_total"),
        "prompt_tokens": value(d, "vllm:prompt_tokens_total"),
        "generation_tokens": value(d, "vllm:generation_tokens_total"),
        "preemptions": value(d, "vllm:num_preemptions_total"),
        "latency": {key: histogram_summary(d, fam) for key, fam in HISTOGRAMS.items()},
        "retro": retro_summary(d),
    }


def counters_of(samples: Mapping[tuple[str, Labels], float]) -> dict[str, float]:
    """The ``_total``/``_count`` samples summed by name: what must stop changing once the
    server has reported a finished run."""
    out: dict[str, float] = {}
    for (n, _), v in samples.items():
        if n.endswith(("_total", "_count")):
            out[n] = out.get(n, 0.0) + v
    return out
