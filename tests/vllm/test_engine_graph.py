"""``--retro-index graph`` (RetrievalAttention's graph index) inside a real vLLM engine
(in-process, CPU, tiny Llama)."""

from __future__ import annotations

import pytest

from tests.vllm.engines import TINY_RETRO, engine, finish_step, greedy, random_prompts
from vllm_retro.kernels import graph_cpu
from vllm_retro.vllm.runtime import get_runtime

pytestmark = [pytest.mark.usefixtures("inprocess"),
              pytest.mark.skipif(graph_cpu.load() is None,
                                 reason=f"graph kernels unavailable: {graph_cpu.load_error()}")]

GRAPH = {**TINY_RETRO, "index": "graph", "graph_block_tokens": 16, "graph_top_k": 16,
         "graph_search_ef": 32, "graph_degree": 8, "graph_knn": 32}
LENGTHS = [30, 60, 90, 700, 1500, 3000]
MAX_TOKENS = [20, 100, 100, 100, 100, 100]


def _generate(llm, lengths, max_tokens):
    outs = llm.generate(random_prompts(lengths), [greedy(m) for m in max_tokens])
    return [list(o.outputs[0].token_ids) for o in outs]


def test_graph_with_every_token_matches_stock_token_for_token(tiny_model_dir):
    # a top-k covering every indexed token is full attention: the same greedy tokens as
    # stock under chunked prefill, mixed lengths and update blocks (64 tokens) inserted
    with engine(tiny_model_dir, max_num_batched_tokens=512) as llm:
        stock = _generate(llm, LENGTHS, MAX_TOKENS)
    with engine(tiny_model_dir, retro={**GRAPH, "graph_top_k": 1 << 16, "build_steps": 4},
                max_num_batched_tokens=512) as llm:
        got = _generate(llm, LENGTHS, MAX_TOKENS)
        rt = get_runtime()
        c = rt.counters
        assert c.requests_indexed == 5 and c.index_updates > 0
        assert c.retro_decode_tokens > 2 * 4 * 90
        finish_step(llm)
        assert rt.live_requests() == [] and rt.live_bytes() == (0, 0)
    assert got == stock


def test_graph_default_budget_decodes_sparse_and_frees_aborted_requests(tiny_model_dir):
    with engine(tiny_model_dir, retro={**GRAPH, "build_steps": 0}) as llm:
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
            layer = next(iter(rt._indexes[rid]))
            idx = rt.index(rid, layer)
            assert type(idx).__name__ == "GraphIndex"
            assert 0 < idx.token_budget() < idx.num_indexed and idx.spec is not None
            # the route hands the prompt's last chunk's queries to the build
            assert idx.trained_on == "queries"
        eng.abort_request(["a"])  # mid-decoding
        while eng.has_unfinished_requests():
            eng.step()
        c = rt.counters
        assert c.sparse_decode_tokens > 100 and c.index_updates > 0
        finish_step(llm)
        assert rt.live_requests() == [] and rt.live_bytes() == (0, 0)
