"""vllm_retro.blocks.tune: block fine-tuning learns under the served mask, resumes to the
same weights after an interruption, records itself, and refuses bad or mismatched runs."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_model import build_tiny_llama
from vllm_retro.blocks.attention import query_starts
from vllm_retro.blocks.tune import (
    Settings,
    TuneError,
    block_mask,
    is_block_tuned,
    main,
    tune,
)
from vllm_retro.capture import real_prose

SETTINGS = dict(steps=6, passages=2, passage_tokens=24, last_tokens=16, lr=3e-3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "prose.txt"
    path.write_text(real_prose(20_000))
    return str(path)


def test_the_mask_is_the_served_one():
    blocks, n = [0, 3, 7], 10
    m = block_mask(blocks, n, torch.float32)[0, 0]
    pos = torch.arange(n)
    starts = query_starts(pos, blocks)
    for q in range(n):
        for k in range(n):
            assert (m[q, k] == 0) == (starts[q] <= k <= q)


def test_tuning_lowers_the_masked_loss_and_records_itself(model, text, tmp_path):
    out = tmp_path / "tuned"
    losses = tune(model, out, Settings(**{**SETTINGS, "steps": 12}, text=text),
                  progress=False, log=lambda _: None)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])
    record = json.loads((out / "config.json").read_text())["retro_block_tuned"]
    assert record["steps"] == 12 and record["settings"]["passages"] == 2
    assert is_block_tuned(out) is True and is_block_tuned(model) is False
    assert is_block_tuned("Qwen/not-a-directory") is None
    assert not (tmp_path / "tuned.work").exists()


def test_an_interrupted_run_resumes_to_the_same_weights(model, text, tmp_path):
    from transformers import AutoModelForCausalLM

    settings = Settings(**SETTINGS, text=text)
    tune(model, tmp_path / "whole", settings, save_every=2, progress=False,
         log=lambda _: None)
    first = tune(model, tmp_path / "cut", settings, save_every=2, progress=False,
                 log=lambda _: None, stop_after=3)
    assert len(first) == 3 and (tmp_path / "cut.work" / "state.pt").exists()
    said = []
    rest = tune(model, tmp_path / "cut", settings, save_every=2, progress=False,
                log=said.append)
    assert len(rest) == 3 and "resuming at step 3 of 6" in said[0]
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "whole").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "cut").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_bad_options_and_another_runs_state_are_refused_by_name(model, text, tmp_path):
    with pytest.raises(TuneError, match=r"--passages=0 is invalid; accepted: an integer"):
        Settings(passages=0)
    with pytest.raises(TuneError, match=r"--lr=2.0 is invalid"):
        Settings(lr=2.0)
    tune(model, tmp_path / "o", Settings(**SETTINGS, text=text), progress=False,
         log=lambda _: None, stop_after=1)
    with pytest.raises(TuneError, match=r"other settings \(lr\); delete it or pass --restart"):
        tune(model, tmp_path / "o", Settings(**{**SETTINGS, "lr": 1e-4}, text=text),
             progress=False, log=lambda _: None)
    assert main([str(tmp_path / "none"), "--out", str(tmp_path / "x")]) == 2
    assert main([str(model), "--out", str(tmp_path / "o"), "--steps", "6", "--passages", "2",
                 "--passage-tokens", "24", "--last-tokens", "16", "--lr", "1e-4",
                 "--text", text, "--restart", "--no-progress", "--device", "cpu"]) == 0
    assert is_block_tuned(tmp_path / "o")
