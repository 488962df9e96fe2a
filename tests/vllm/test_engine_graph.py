"""``--retro-index graph`` (RetrievalAttention's graph index) inside a real vLLM engine
(in-process, CPU, tiny Llama)."""

from __future__ import annotations

import pytest

from tests.vllm.engines import TINY_RETRO, decode_two_abort_one, engine, full_budget_matches_stock
from vllm_retro.kernels import graph_cpu

pytestmark = [pytest.mark.usefixtures("inprocess"),
              pytest.mark.skipif(graph_cpu.load() is None,
                                 reason=f"graph kernels unavailable: {graph_cpu.load_error()}")]

GRAPH = {**TINY_RETRO, "index": "graph", "graph_block_tokens": 16, "graph_top_k": 16,
         "graph_search_ef": 32, "graph_degree": 8, "graph_knn": 32}


def test_graph_with_every_token_matches_stock_token_for_token(tiny_model_dir):
    # a top-k covering every indexed token is full attention: the same greedy tokens as
    # stock under chunked prefill, mixed lengths and update blocks (64 tokens) inserted
    full_budget_matches_stock(tiny_model_dir,
                              {**GRAPH, "graph_top_k": 1 << 16, "build_steps": 4})


def test_graph_default_budget_decodes_sparse_and_frees_aborted_requests(tiny_model_dir):
    def check(rt):
        for rid in rt.registry.live():
            layer = next(iter(rt.registry.indexes_of(rid)))
            idx = rt.index(rid, layer)
            assert type(idx).__name__ == "GraphIndex"
            assert 0 < idx.token_budget() < idx.num_indexed and idx.spec is not None
            # the route hands the prompt's last chunk's queries to the build
            assert idx.trained_on == "queries"

    with engine(tiny_model_dir, retro={**GRAPH, "build_steps": 0}) as llm:
        decode_two_abort_one(llm, check)
