"""``bench.gpu``: the reduced CPU mode in-process, exactness at full budgets, the CUDA path."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from bench.gpu.cli import run
from bench.gpu.stacks import sdpa_probe

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASE_KEYS = {
    "context", "batch", "dense_step_ms", "retro_step_ms", "step_time_ratio", "speedup",
    "dense_tokens_per_s", "retro_tokens_per_s", "h2d_bytes_per_step", "d2d_bytes_per_step",
    "host_tokens_per_step", "host_clusters_per_step", "index_build_ms_per_layer",
    "prefill_attention_ms_per_layer", "build_over_prefill", "rel_err_mean", "rel_err_max",
    "dense_peak_device_bytes", "retro_peak_device_bytes", "dense_resident_device_bytes",
    "retro_resident_device_bytes", "clusters_per_head", "steps",
}


def _check_case(case: dict) -> None:
    assert case.keys() >= CASE_KEYS, CASE_KEYS - case.keys()
    for key, value in case.items():
        if isinstance(value, float):
            assert math.isfinite(value), key
    for key in ("h2d_bytes_per_step", "d2d_bytes_per_step", "dense_resident_device_bytes",
                "retro_resident_device_bytes", "host_tokens_per_step",
                "host_clusters_per_step"):
        assert case[key] >= 0
    assert case["dense_step_ms"] > 0 and case["retro_step_ms"] > 0
    assert case["clusters_per_head"] > 0  # the context is long enough to be indexed


def _check_result(result: dict, out: pathlib.Path) -> None:
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for key in ("device", "torch", "triton", "shape", "dtype", "config", "cases"):
        assert key in result
    assert result["cases"]
    for case in result["cases"]:
        assert "skipped" not in case, case.get("skipped")
        _check_case(case)


def test_reduced_cpu(tmp_path: pathlib.Path) -> None:
    """The reduced mode runs (default budgets), writes the documented JSON, and the retro
    output approximates dense attention on the structured synthetic data."""
    out = tmp_path / "gpu.json"
    result = run(["--device", "cpu", "--reduced", "--batches", "1", "2", "--steps", "2",
                  "--kmeans-iters", "3",
                  "--out", str(out)])
    _check_result(result, out)
    assert result["reduced"] and result["kernel_backend"] == "auto"
    assert [c["batch"] for c in result["cases"]] == [1, 2]
    for case in result["cases"]:
        # no device cache on this path: every retrieved cluster is read from the host tier
        assert case["h2d_bytes_per_step"] > 0 and case["host_clusters_per_step"] > 0
        assert case["rel_err_mean"] < 0.5


def test_full_budget_is_exact(tmp_path: pathlib.Path) -> None:
    """retrieval_budget=1.0 (no estimation): every cluster is read exactly, so retro's
    output equals dense attention up to fp32 rounding."""
    out = tmp_path / "gpu.json"
    result = run(["--device", "cpu", "--reduced", "--batches", "1", "--steps", "2",
                  "--warmup", "0", "--layers", "1", "--kmeans-iters", "2",
                  "--retrieval-budget", "1.0", "--out", str(out)])
    _check_result(result, out)
    assert result["config"]["estimation_budget"] == 0.0
    assert result["cases"][0]["rel_err_max"] < 1e-4


def _record_sdpa(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool, bool]]:
    """From now on, every SDPA call's (shape: "decode" for 1 query, "square" or
    "non-square", is_causal, enable_gqa)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        n, m = q.shape[-2], k.shape[-2]
        calls.append(("decode" if n == 1 else "square" if n == m else "non-square",
                      is_causal, enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    return calls


def test_sdpa_probe_calls_sdpa_as_the_bench_does(tmp_path: pathlib.Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe that picks the CUDA SDPA backend makes the kinds of call the bench makes,
    and only those: the dense decode's 1 query, not causal, and the prefill timing's square
    causal call, both GQA. No causal call is non-square (FlashAttention refuses those, the
    CPU does not, so the reduced mode alone would not show it)."""
    calls = _record_sdpa(monkeypatch)
    sdpa_probe(torch.device("cpu"), torch.float32, 16)
    probed = set(calls)
    calls.clear()
    run(["--device", "cpu", "--reduced", "--batches", "1", "--steps", "1", "--warmup", "0",
         "--layers", "1", "--kmeans-iters", "1", "--out", str(tmp_path / "gpu.json")])
    assert probed == set(calls) == {("decode", False, True), ("square", True, True)}


def test_skips_what_does_not_fit(tmp_path: pathlib.Path) -> None:
    """A case over the host limit is recorded as skipped, with its reason, not run."""
    out = tmp_path / "gpu.json"
    result = run(["--device", "cpu", "--reduced", "--batches", "1", "--contexts", "4096",
                  "--host-limit-gib", "0.001", "--out", str(out)])
    (case,) = result["cases"]
    assert "host memory" in case["skipped"]
    assert "dense_step_ms" not in case


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_size_cuda(tmp_path: pathlib.Path) -> None:
    """Full head geometry on CUDA (2 layers, 8K context), with real Triton kernels: run in a
    subprocess without TRITON_INTERPRET (set for this process by tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for budget, out in (("0.018", tmp_path / "default.json"), ("1.0", tmp_path / "exact.json")):
        subprocess.run(
            [sys.executable, "-m", "bench.gpu", "--device", "cuda", "--contexts", "8192",
             "--batches", "1", "2", "--layers", "2", "--steps", "3", "--warmup", "1",
             "--retrieval-budget", budget, "--out", str(out)],
            cwd=ROOT, env=env, check=True, timeout=600)
        result = json.loads(out.read_text())
        _check_result(result, out)
        assert result["device_type"] == "cuda" and result["dtype"] == "bfloat16"
        for case in result["cases"]:
            assert case["dense_peak_device_bytes"] > 0 and case["retro_peak_device_bytes"] > 0
            if budget == "1.0":
                assert case["rel_err_max"] < 2e-2  # bf16 rounding of two different kernels
