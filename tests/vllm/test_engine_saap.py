"""``--retro-index saap`` inside a real vLLM engine (in-process, CPU, tiny Llama), with a
SAAP file calibrated for that model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.vllm.engines import TINY_RETRO, engine, finish_step, greedy, random_prompts
from vllm_retro.index.saap_model import ModelIdentity, random_saap_model
from vllm_retro.saap.calibrate import Settings, calibrate
from vllm_retro.vllm.runtime import get_runtime

pytestmark = pytest.mark.usefixtures("inprocess")

BUCKETS = 8
LENGTHS = [30, 60, 90, 700, 1500, 3000]
MAX_TOKENS = [20, 100, 100, 100, 100, 100]


@pytest.fixture(scope="module")
def saap_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SAAP file calibrated for the tiny model (8 buckets; layer 0 dense)."""
    out = tmp_path_factory.mktemp("saap") / "tiny.saap"
    calibrate(tiny_model_dir, out, Settings(buckets=BUCKETS, hidden=16, tokens=1280,
                                            prompt_tokens=640, query_samples=32, steps=20,
                                            eval_probes=2),
              progress=False, log=lambda _: None)
    return out


def _generate(llm, lengths, max_tokens):
    outs = llm.generate(random_prompts(lengths), [greedy(m) for m in max_tokens])
    return [list(o.outputs[0].token_ids) for o in outs]


def test_saap_with_every_bucket_matches_stock_token_for_token(tiny_model_dir, saap_file):
    # visiting every bucket is full attention: the same greedy tokens as stock under chunked
    # prefill, mixed lengths, background builds and update blocks (64 tokens)
    with engine(tiny_model_dir, max_num_batched_tokens=512) as llm:
        stock = _generate(llm, LENGTHS, MAX_TOKENS)
    retro = {**TINY_RETRO, "index": "saap", "saap_file": str(saap_file),
             "saap_probes": BUCKETS, "build_steps": 4}
    with engine(tiny_model_dir, retro=retro, max_num_batched_tokens=512) as llm:
        got = _generate(llm, LENGTHS, MAX_TOKENS)
        rt = get_runtime()
        c = rt.counters
        assert c.requests_indexed == 5 and c.index_updates > 0
        assert c.retro_decode_tokens > 2 * 4 * 90
        finish_step(llm)
        assert rt.live_requests() == [] and rt.live_bytes() == (0, 0)
    assert got == stock


def test_saap_decodes_sparse_and_frees_aborted_requests(tiny_model_dir, saap_file):
    retro = {**TINY_RETRO, "index": "saap", "saap_file": str(saap_file), "saap_probes": 2,
             "build_steps": 0}
    with engine(tiny_model_dir, retro=retro) as llm:
        rt = get_runtime()
        eng = llm.llm_engine
        a, b = random_prompts([2000, 2500], seed=5)
        eng.add_request("a", a, greedy(150))
        eng.add_request("b", b, greedy(100))
        for _ in range(300):
            eng.step()
            if rt.counters.retro_decode_tokens >= 2 * 2 * 20:
                break
        live = rt.live_requests()
        assert len(live) == 2
        for rid in live:
            for name, idx in rt._indexes[rid].items():
                assert type(idx).__name__ == "SaapIndex" and idx.num_buckets == BUCKETS
                # layer 0 is dense (every bucket), as the paper serves it
                assert idx.probes == (BUCKETS if idx.layer == 0 else 2), name
        eng.abort_request(["a"])  # mid-decoding
        while eng.has_unfinished_requests():
            eng.step()
        c = rt.counters
        assert c.sparse_decode_tokens > 100 and c.index_updates > 0
        finish_step(llm)
        assert rt.live_requests() == [] and rt.live_bytes() == (0, 0)


def test_saap_probes_beyond_the_files_buckets_fail_at_startup(tiny_model_dir, saap_file):
    with pytest.raises(Exception, match=rf"saap_probes=9 is invalid; accepted: an integer in "
                                        rf"\[1, {BUCKETS}\] \(the buckets of saap file"), \
            engine(tiny_model_dir, retro={"index": "saap", "saap_file": str(saap_file),
                                          "saap_probes": 9}):
        pass


def test_a_file_for_another_model_is_refused(tiny_model_dir, tmp_path):
    idn = ModelIdentity.of_directory(tiny_model_dir)
    path = tmp_path / "other.saap"
    random_saap_model(replace(idn, num_layers=3, fingerprint="0" * 16), BUCKETS, 16).save(path)
    retro = {**TINY_RETRO, "index": "saap", "saap_file": str(path), "saap_probes": 4,
             "build_steps": 0}
    with pytest.raises(Exception, match=r"was trained for 3 layers x 2 KV heads x head_dim 32"), \
            engine(tiny_model_dir, retro=retro) as llm:
        _generate(llm, [500], [4])
