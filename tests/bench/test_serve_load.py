"""``bench.serve_load`` against a spawned tiny-model ``vllm-retro serve``, and the Prometheus
helpers of ``bench.serve_metrics`` on synthetic text."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import serve_metrics as sm

REQUESTS = 8
MAX_TOKENS = 16

HIST_BEFORE = """\
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.05
vllm:prompt_tokens_total{engine="0",model_name="m"} 10.0
vllm_retro:decode_tokens_total{engine="0",model_name="m",route="sparse"} 3.0
vllm_retro:decode_tokens_total{engine="0",model_name="m",route="dense"} 4.0
"""

HIST_AFTER = """\
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 9.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 11.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 11.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 8.05
vllm:prompt_tokens_total{engine="0",model_name="m"} 110.0
vllm_retro:decode_tokens_total{engine="0",model_name="m",route="sparse"} 13.0
vllm_retro:decode_tokens_total{engine="0",model_name="m",route="dense"} 4.0
"""


def test_histogram_deltas_and_interpolated_quantiles() -> None:
    """Deltas per sample; mean from _sum/_count; quantiles interpolated inside buckets, and
    a quantile in the +Inf bucket reported as the highest finite bound."""
    d = sm.delta(sm.parse(HIST_BEFORE), sm.parse(HIST_AFTER))
    assert sm.value(d, "vllm:prompt_tokens_total") == 100
    assert sm.value(d, "vllm_retro:decode_tokens_total", route="sparse") == 10
    assert sm.value(d, "vllm_retro:decode_tokens_total") == 10
    h = sm.histogram_summary(d, "vllm:time_to_first_token_seconds")
    assert h["count"] == 10 and h["mean"] == pytest.approx(0.8)
    # delta buckets: (0.1, 0), (0.5, 4), (1.0, 8), (inf, 10)
    assert h["p50"] == pytest.approx(0.5 + 0.5 * (5 - 4) / 4)
    assert h["p90"] == 1.0 and h["p99"] == 1.0
    assert sm.bucket_quantile(0.2, [(0.1, 0.0), (0.5, 4.0)]) == pytest.approx(0.1 + 0.4 * 0.2)
    assert math.isnan(sm.histogram_summary({}, "vllm:time_to_first_token_seconds")["p50"])


def test_serve_load_against_spawned_tiny_server(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Four concurrent streaming clients, 8 requests of ~600 prompt tokens and 16 output
    tokens, against a tiny-model server the bench spawns and stops: no errors, the client's
    token sums equal the server's /metrics deltas exactly, every request was indexed, one TTFT
    observation per request, ordered percentiles, JSON and PNG written."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    from bench import serve_load
    from tests.tiny_model import build_tiny_llama

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_tiny_llama(tmp_path / "tiny-llama")
    out = tmp_path / "serve_load_tiny.json"
    report = serve_load.main([
        "--spawn-server", str(model), "--api-key", "sk-bench", "--concurrency", "4",
        "--requests", str(REQUESTS), "--prompt-tokens", "600", "--max-tokens", str(MAX_TOKENS),
        # the suite's first server start on a fresh machine also compiles vLLM's bytecode:
        # over 300 s once in CI
        "--seed", "1", "--out", str(out), "--ready-timeout", "900",
        "--", "--served-model-name", "tiny-llama", "--dtype", "float32",
        "--max-model-len", "4096", "--retro-update-segment", "64", "--api-key", "sk-bench"])

    client, server = report["client"], report["server"]
    assert client["errors"] == 0, client["error_messages"]
    assert client["succeeded"] == REQUESTS and client["short_outputs"] == 0
    assert client["timed_token_mismatches"] == 0  # per-chunk usage adds up to the total
    assert client["generation_tokens"] == REQUESTS * MAX_TOKENS
    assert all(r["prompt_tokens"] > 300 for r in report["per_request"])
    assert server["prompt_tokens"] == client["prompt_tokens"]
    assert server["generation_tokens"] == client["generation_tokens"]
    assert server["requests_succeeded"] == REQUESTS
    assert server["latency"]["ttft_s"]["count"] == REQUESTS
    assert server["latency"]["itl_s"]["count"] == REQUESTS * (MAX_TOKENS - 1)
    assert client["latency"]["itl_s"]["count"] == REQUESTS * (MAX_TOKENS - 1)
    assert server["retro"]["indexed_requests"] == REQUESTS
    assert server["retro"]["indexed_tokens"] == client["prompt_tokens"]
    assert server["retro"]["sparse_decode_tokens"] > 0
    for side in (client, server):
        for key in ("ttft_s", "itl_s", "e2e_s"):
            lat = side["latency"][key]
            assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"], (key, lat)
    assert report["server_stop_s"] is not None
    written = json.loads(out.read_text())
    assert written["client"]["prompt_tokens"] == client["prompt_tokens"]
    assert "--spawn-server" in written["command"]
    assert {r["metric"] for r in written["comparison"]} >= {"prompt tokens", "ttft_s p99"}
    assert out.with_suffix(".png").stat().st_size > 0
