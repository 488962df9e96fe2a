"""``--retro-index saap`` inside a real vLLM engine (in-process, CPU, tiny Llama), with a
SAAP file calibrated for that model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.vllm.engines import (
    SAAP_BUCKETS,
    TINY_RETRO,
    decode_two_abort_one,
    engine,
    full_budget_matches_stock,
    generate_tokens,
)
from vllm_retro.index.saap_model import ModelIdentity, random_saap_model

pytestmark = pytest.mark.usefixtures("inprocess")

def test_saap_with_every_bucket_matches_stock_token_for_token(tiny_model_dir, saap_file):
    # visiting every bucket is full attention: the same greedy tokens as stock under chunked
    # prefill, mixed lengths, background builds and update blocks (64 tokens)
    full_budget_matches_stock(tiny_model_dir, {
        **TINY_RETRO, "index": "saap", "saap_file": str(saap_file), "saap_probes": SAAP_BUCKETS,
        "build_steps": 4})


def test_saap_decodes_sparse_and_frees_aborted_requests(tiny_model_dir, saap_file):
    def check(rt):
        for rid in rt.registry.live():
            for name, idx in rt.registry.indexes_of(rid).items():
                assert type(idx).__name__ == "SaapIndex" and idx.num_buckets == SAAP_BUCKETS
                # layer 0 is dense (every bucket), as the paper serves it
                assert idx.probes == (SAAP_BUCKETS if idx.layer == 0 else 2), name

    retro = {**TINY_RETRO, "index": "saap", "saap_file": str(saap_file), "saap_probes": 2,
             "build_steps": 0}
    with engine(tiny_model_dir, retro=retro) as llm:
        decode_two_abort_one(llm, check)


def test_saap_probes_beyond_the_files_buckets_fail_at_startup(tiny_model_dir, saap_file):
    with pytest.raises(Exception, match=rf"saap_probes=9 is invalid; accepted: an integer in "
                                        rf"\[1, {SAAP_BUCKETS}\] \(the buckets of saap file"), \
            engine(tiny_model_dir, retro={"index": "saap", "saap_file": str(saap_file),
                                          "saap_probes": 9}):
        pass


def test_a_file_for_another_model_is_refused(tiny_model_dir, tmp_path):
    idn = ModelIdentity.of_directory(tiny_model_dir)
    path = tmp_path / "other.saap"
    random_saap_model(replace(idn, num_layers=3, fingerprint="0" * 16), SAAP_BUCKETS, 16).save(path)
    retro = {**TINY_RETRO, "index": "saap", "saap_file": str(path), "saap_probes": 4,
             "build_steps": 0}
    with pytest.raises(Exception, match=r"was trained for 3 layers x 2 KV heads x head_dim 32"), \
            engine(tiny_model_dir, retro=retro) as llm:
        generate_tokens(llm, [500], [4])
