"""Command-line options, quick-mode defaults and the accuracy gate (no model)."""

from __future__ import annotations

import json

import pytest

from bench.accuracy.__main__ import QUICK_MARGIN, gate, parse_args
from bench.accuracy.runner import CONFIGS, settings
from bench.accuracy.tasks import TASKS
from vllm_retro.config import RetroConfig


def test_defaults_run_everything_at_4k_and_8k():
    args = parse_args([])
    assert args.contexts == [4096, 8192] and args.tasks == list(TASKS)
    assert args.configs == [c for c in CONFIGS if c != "saap"] and args.margin is None
    assert args.out == "bench/results/accuracy_{ctx}.json"
    # SAAP runs by default once its trained file is given, and takes that file
    assert parse_args(["--saap-file", "m.saap"]).configs == list(CONFIGS)
    assert settings("saap", "m.saap") == {"index": "saap", "saap_file": "m.saap"}
    assert settings("graph") == {"index": "graph"} and settings("full") is None
    with pytest.raises(SystemExit, match="needs --saap-file"):
        settings("saap")


def test_quick_mode_is_small_and_gated():
    args = parse_args(["--quick"])
    assert args.tasks == ["niah_single"] and args.configs == ["full", "retro"]
    assert len(args.contexts) == 1 and 2000 <= args.contexts[0] <= 3000
    assert args.samples <= 4 and args.margin == QUICK_MARGIN
    assert parse_args(["--quick", "--samples", "5", "--margin", "0.1"]).samples == 5


def test_several_contexts_need_a_ctx_placeholder():
    with pytest.raises(SystemExit):
        parse_args(["--contexts", "1024", "2048", "--out", "x.json"])
    assert parse_args(["--contexts", "1024", "--out", "x.json"]).out == "x.json"


def test_config_knobs():
    assert CONFIGS["full"] is None and CONFIGS["retro"] == {}
    half, double = RetroConfig(**CONFIGS["retro_half"]), RetroConfig(**CONFIGS["retro_double"])
    for clusters in (256, 512, 4096, 8192):  # 4K to 128K tokens
        r = RetroConfig().num_retrieval(clusters)
        assert half.num_retrieval(clusters) in (r // 2, r // 2 + 1)
        assert double.num_retrieval(clusters) in (2 * r - 1, 2 * r)
    assert CONFIGS["retro_no_est"] == {"estimation_budget": 0.0}
    assert CONFIGS["retro_centroid"] == {"estimator": "centroid"}


def test_gate():
    summary = {"mean": {"full": 1.0, "retro": 0.67, "retro_half": 0.5}}
    assert gate(summary, QUICK_MARGIN) == ["retro_half"]
    assert gate(summary, 0.6) == []
    assert gate({"mean": {"retro": 0.0}}, 0.1) == []  # no full-attention baseline


def test_resume_takes_finished_runs_of_the_same_command_only(tmp_path):
    from bench.accuracy.__main__ import resumed_runs

    partial = tmp_path / "acc_4096.partial.json"
    assert resumed_runs(partial, "cmd", ["full", "retro"]) == []
    runs = [{"config": "full", "samples": []}]
    partial.write_text(json.dumps({"command": "cmd", "complete": False, "runs": runs}))
    assert resumed_runs(partial, "cmd", ["full", "retro"]) == runs
    assert resumed_runs(partial, "other cmd", ["full", "retro"]) == []
    assert resumed_runs(partial, "cmd", ["retro", "full"]) == []
    partial.write_text("{not json")
    assert resumed_runs(partial, "cmd", ["full"]) == []
