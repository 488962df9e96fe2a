"""``--retro-index quest`` and ``--retro-index streaming`` (Quest and StreamingLLM as
serving policies) inside a real vLLM engine (in-process, CPU, tiny Llama)."""

from __future__ import annotations

import pytest

from tests.vllm.engines import TINY_RETRO, decode_two_abort_one, engine, full_budget_matches_stock

pytestmark = pytest.mark.usefixtures("inprocess")


@pytest.mark.parametrize("kind", ["quest", "streaming"])
def test_a_budget_of_every_token_matches_stock_token_for_token(kind, tiny_model_dir):
    # reading every page is full attention: the same greedy tokens as stock under chunked
    # prefill, mixed lengths and update blocks (64 tokens)
    full_budget_matches_stock(tiny_model_dir, {**TINY_RETRO, "index": kind,
                                               "quest_token_budget": 1 << 20,
                                               "streaming_tokens": 1 << 20, "build_steps": 4})


@pytest.mark.parametrize("kind", ["quest", "streaming"])
def test_default_budget_decodes_sparse_and_frees_aborted_requests(kind, tiny_model_dir):
    def check(rt):
        for rid in rt.registry.live():
            layer = next(iter(rt.registry.indexes_of(rid)))
            idx = rt.index(rid, layer)
            assert idx.config.index == kind and type(idx).__name__ == {
                "quest": "QuestIndex", "streaming": "StreamingIndex"}[kind]
            assert 0 < idx.num_pages < idx.num_clusters  # sparse: some pages only

    retro = {**TINY_RETRO, "index": kind, "quest_token_budget": 256, "streaming_tokens": 256,
             "build_steps": 0}
    with engine(tiny_model_dir, retro=retro) as llm:
        decode_two_abort_one(llm, check)
