"""``bench.soak``'s short version (the CI soak): a spawned tiny-model server with faults on,
a few dozen mixed requests, disconnects in every phase, every fault once — the run's own
verdict must be empty; and its pieces (the plan, the traceback scan) on their own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import soak


def _args(**kw) -> argparse.Namespace:
    args = soak.build_parser().parse_args(["--url", "http://x"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_the_plan_holds_every_kind_phase_and_fault() -> None:
    args = _args(requests=300, aborts=65, faults=True, faults_each=5)
    reqs = soak.plan_requests(args, 32768, [600, 2000, 5000, 9000])
    assert len(reqs) == 300 and sorted(r.index for r in reqs) == list(range(300))
    kinds = {k: sum(r.kind == k for r in reqs) for k in ("abort", "fault", "bad", "needle")}
    assert kinds == {"abort": 65, "fault": 25, "bad": 15, "needle": 45}
    assert {r.phase for r in reqs if r.kind == "abort"} == set(soak.PHASES)
    for site in soak.FAULT_SITES:
        assert sum(r.site == site for r in reqs) == 5
    # a fault's needle is indexed; the late fault decodes past its first update block
    assert all(r.needle != 0 for r in reqs if r.site in soak.ANSWERED_FAULTS)
    assert all(r.max_tokens > 1024 for r in reqs if r.site == "host_alloc_late")
    prose = [r for r in reqs if r.kind == "prose"]
    assert min(r.prompt_tokens for r in prose) < 100
    assert max(r.prompt_tokens + r.max_tokens for r in prose) > 32000
    assert any(r.n == 2 for r in prose) and {r.api for r in prose} == {"chat", "completions"}
    assert reqs == soak.plan_requests(args, 32768, [600, 2000, 5000, 9000])  # seeded


def test_tracebacks_are_told_apart_by_their_cause() -> None:
    log = "\n".join([
        "ERROR retro: building layer 0 of request soak-1-retro-fault-index_build failed",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in f',
        "vllm_retro.faults.InjectedFault: injected fault at index_build for request r",
        "INFO something",
        "Traceback (most recent call last):",
        '  File "y.py", line 2, in g',
        "ValueError: real trouble",
    ])
    found = soak.tracebacks(log)
    assert [t["injected"] for t in found] == [True, False]
    assert found[1]["exception"] == "ValueError: real trouble"


def test_short_soak_against_a_tiny_server_with_every_fault(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    pytest.importorskip("vllm")
    from tests.tiny_model import build_tiny_llama

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_tiny_llama(tmp_path / "tiny-llama")
    report = soak.main([
        "--spawn", str(model), "--faults", "--faults-each", "1", "--requests", "40",
        "--concurrency", "8", "--aborts", "10", "--bad-share", "0.15",
        "--max-context", "2048", "--min-indexed", "132", "--update-segment", "64",
        "--label", "ci_tiny", "--out", str(tmp_path), "--timeout", "300",
        "--", "--served-model-name", "tiny-llama", "--dtype", "float32",
        "--max-model-len", "4096", "--retro-update-segment", "64"])
    assert report["verdict"] == [], report["verdict"]
    s = report["summary"]
    assert s["requests"] == 40
    assert sum(a["planned"] for a in s["aborts"].values()) == 10
    assert sum(a["aborted"] for a in s["aborts"].values()) >= 8
    assert s["outcomes"]["bad"] == {"rejected": 6}
    assert s["outcomes"]["fault:kernel_row"] == {"error": 1}
    assert s["outcomes"]["fault:index_build"] == {"answered": 1}
    assert report["gauges_zero_after_s"] <= 10
    written = json.loads((tmp_path / "soak_ci_tiny.json").read_text())
    assert written["verdict"] == []
    assert (tmp_path / "soak_ci_tiny.png").stat().st_size > 0


def test_memory_that_grows_from_round_to_round_fails_the_run() -> None:
    """With ``--rounds`` the first round may raise resident memory to its pools' high-water
    mark; growing again in a later round is a leak."""
    base = {"summary": {"needles": {"worse_than_alone": []}}, "results": [],
            "gauges_zero_after_s": 0.1, "gauges_after": {}, "tracebacks": [],
            "rss_ratio_after_to_warm": 1.0}
    args = _args(rounds=3)
    assert soak.verdict({**base, "rss_ratio_last_to_first_round": 1.01}, args) == []
    bad = soak.verdict({**base, "rss_ratio_last_to_first_round": 1.04}, args)
    assert len(bad) == 1 and "grew 1.040x" in bad[0] and "a leak" in bad[0]
    bad = soak.verdict({**base, "rss_ratio_after_to_warm": 1.09}, args)
    assert len(bad) == 1 and "1.090x after warm-up" in bad[0]
