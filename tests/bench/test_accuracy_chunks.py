"""The accuracy harness served in chunks (``--chunk``): a checkpoint after each batch of
prompts, and a resumed configuration that serves only the prompts not answered yet. On the
tiny Llama, so the answers are noise but real engine output."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from bench.accuracy.runner import make_samples, run_config, sample_key, tokenizer_fns  # noqa: E402
from tests.tiny_model import build_tiny_llama  # noqa: E402
from tests.vllm.engines import variables_changed_since  # noqa: E402


def test_chunks_checkpoint_and_a_resumed_run_serves_only_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_tiny_llama(tmp_path / "tiny")
    samples = make_samples(["niah_single"], [400], 3, 0, *tokenizer_fns(model))
    saved: list[dict] = []
    environment = dict(os.environ)  # (vllm is imported: importorskip above)
    whole = run_config(model, "full", samples, log=lambda _: None, dtype="float32", chunk=1,
                       checkpoint=saved.append)
    # nothing the engine set is left for servers started later (VLLM_ENABLE_V1_MULTIPROCESSING=0
    # left behind once made a later test's server run without its worker process)
    assert not variables_changed_since(environment), variables_changed_since(environment)
    assert "complete" not in whole
    assert [sample_key(r) for r in whole["samples"]] == [sample_key(s.record())
                                                         for s in samples]
    # one checkpoint after every batch but the last (the caller writes the finished run)
    assert [len(c["samples"]) for c in saved] == [1, 2]
    assert all(c["complete"] is False and c["config"] == "full" for c in saved)

    # resume from the first checkpoint: its answer is kept as written (here marked, to show
    # it is not served again); the other two are served, greedy, as before
    done = {**saved[0], "samples": [{**saved[0]["samples"][0], "answer": "kept"}]}
    resumed = run_config(model, "full", samples, log=lambda _: None, dtype="float32",
                         chunk=1, done=done)
    answers = [r["answer"] for r in resumed["samples"]]
    assert answers == ["kept"] + [r["answer"] for r in whole["samples"][1:]]
    assert resumed["wall_s"] >= done["wall_s"]


def test_the_command_resumes_an_unfinished_configuration(tmp_path, monkeypatch, capsys):
    """``python -m bench.accuracy ... --chunk 1``, interrupted after full attention's first
    answer (its checkpoint as the run left it): run again, it keeps that answer, serves the
    rest, and writes the result with every answer."""
    import json
    import shlex

    from bench.accuracy.__main__ import main, write_checkpoint

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "acc_{ctx}.json"
    argv = ["--contexts", "400", "--tasks", "niah_single", "--samples", "2", "--configs",
            "full", "--chunk", "1", "--model", str(model), "--out", str(out),
            "--dtype", "float32"]
    samples = make_samples(["niah_single"], [400], 2, 0, *tokenizer_fns(model))
    first = {**samples[0].record(), "answer": "kept", "score": 0.0}
    partial = tmp_path / "acc_400.partial.json"
    write_checkpoint(partial, "python -m bench.accuracy " + shlex.join(argv), 400, [],
                     {"config": "full", "retro": None, "wall_s": 1.0, "engine_start_s": 0.0,
                      "samples": [first], "complete": False})
    assert main(argv) == 0
    assert "full (1 answers so far)" in capsys.readouterr().out
    result = json.loads((tmp_path / "acc_400.json").read_text())
    answers = [s["answer"] for s in result["runs"][0]["samples"]]
    assert len(answers) == 2 and answers[0] == "kept" and answers[1] != "kept"
    assert not partial.exists()
