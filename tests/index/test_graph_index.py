"""RetrievalAttention's graph index as a serving index: its selection against a plain
reference written from the paper (each query head's greedy best-first search of its KV
head's graph, the GQA group's union), exact attention over what it selects, full budgets,
bad options, freed memory, and attention accuracy on real Qwen2.5 data."""

from __future__ import annotations

import pytest
import torch

from vllm_retro.buffer.manager import WaveBufferManager
from vllm_retro.config import ConfigError, RetroConfig
from vllm_retro.index import graph as gr
from vllm_retro.index.baselines import OracleIndex
from vllm_retro.index.batched import decode_batch
from vllm_retro.index.evaluate import evaluate_policy
from vllm_retro.index.graph_index import GraphIndex
from vllm_retro.kernels import graph_cpu

H, G, D = 2, 4, 64
SCALE = D ** -0.5
CFG = RetroConfig(index="graph", kernel_backend="torch", sink_tokens=4, local_window=32,
                  update_segment=128, graph_block_tokens=16, graph_top_k=20,
                  graph_search_ef=32, graph_degree=8, graph_knn=20, cache_fraction=0.1)

pytestmark = pytest.mark.skipif(graph_cpu.load() is None,
                                reason=f"graph kernels unavailable: {graph_cpu.load_error()}")


def reference_selection(index: GraphIndex, keys: torch.Tensor, query: torch.Tensor,
                        budget: int | None) -> list[list[int]]:
    """The paper's retrieval from first principles, on the index's graph: each query head
    runs the greedy best-first search (:func:`~vllm_retro.index.graph.search_ref`) of its KV
    head's graph from its entry for its top ``k`` keys by ``q . k``; a KV head reads the
    union of its group's (with ``budget``: the ``budget`` best of their pools by the
    group's summed softmax). keys: every token's [H, n, D]. Returns each KV head's
    ascending token indices (indexed position - sinks)."""
    n, sinks = index.num_indexed, index.num_sinks
    cfg = index.config
    k = cfg.graph.top_k if budget is None else budget
    if k >= n:
        return [list(range(n))] * H
    ef = max(cfg.graph.search_ef, k)
    indexed = keys[:, sinks:sinks + n]
    ids = torch.full((H, G, ef), -1, dtype=torch.int64)
    for h in range(H):
        adj = index.adj.buf[h, :n]
        for j in range(G):
            found, _, _ = gr.search_ref(indexed[h], adj, index.entries[h].tolist(),
                                        query[h * G + j], ef)
            ids[h, j, :len(found)] = torch.tensor([v for _, v in found])
    rows = torch.arange(H * n).reshape(H, n)
    return gr.merge_group_ref(ids, query.reshape(H, G, D), indexed.reshape(-1, D), rows, SCALE,
                              k, budget)


def reference_attention(index: GraphIndex, keys: torch.Tensor, values: torch.Tensor,
                        query: torch.Tensor, chosen: list[list[int]]) -> torch.Tensor:
    """Exact attention of query [H * G, D] over the steady zone and each KV head's
    ``chosen`` indexed tokens; keys/values: every token's [H, n, D]. Returns [H * G, D]."""
    sinks, n = index.num_sinks, index.num_tokens
    q = query.reshape(H, G, D).double()
    steady = torch.cat([torch.arange(sinks), torch.arange(index.window_start, n)])
    out = []
    for h in range(H):
        pos = torch.cat([steady, sinks + torch.tensor(chosen[h], dtype=torch.int64)])
        p = torch.softmax(q[h] @ keys[h, pos].double().T * SCALE, dim=-1)
        out.append(p @ values[h, pos].double())
    return torch.cat(out).float()


def _ints(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Small integers (fp32): every q . k exact in the kernel and the reference alike."""
    return torch.randint(-2, 3, shape, generator=gen).float()


def _run(index: GraphIndex, steps: int, gen: torch.Generator, keys: torch.Tensor,
         values: torch.Tensor, check, every: int = 1) -> None:
    for s in range(steps):
        q = _ints(gen, H * G, D)
        if s % every == 0:
            check(index, keys, values, q)
        nk, nv = _ints(gen, H, 1, D), torch.randn(H, 1, D, generator=gen)
        index.append(nk, nv)
        keys, values = torch.cat([keys, nk], 1), torch.cat([values, nv], 1)


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("backed", ["dense", "buffer"])
def test_decode_is_the_papers_selection_and_exact_attention(backed, backend, rng):
    # 'torch': search in C++, then the choice, gather and attention in torch (CUDA's path);
    # 'auto' on the CPU: one fused kernel searches, chooses and attends in place
    cfg = CFG.replace(kernel_backend=backend)
    keys, values = _ints(rng, H, 1500, D), torch.randn(H, 1500, D, generator=rng)
    prefill_q = _ints(rng, H * G, 100, D)
    mgr = WaveBufferManager(cfg)
    store = mgr.store("r", H, D, torch.float32, "cpu", layer="L") if backed == "buffer" else None
    index = GraphIndex.build(keys, values, cfg, store=store, queries=prefill_q)
    assert index.fused(torch.zeros(1)) == (backend == "auto")
    assert index.num_indexed == 1500 - 4 - 32 and index.adj.buf.shape[2] == 2 * 8
    assert index.queries is None  # the prefill queries are dropped once the graph is built
    seen = {"steps": 0, "sizes": set()}

    def check(index, keys, values, q):
        res = index.decode(q, SCALE, return_positions=True)
        got = [[v for v in row if v >= 0] for row in res.selection.retrieval_ids.tolist()]
        want = reference_selection(index, keys, q, None)
        assert got == want
        assert all(CFG.graph.top_k <= len(w) <= G * CFG.graph.top_k for w in want)
        torch.testing.assert_close(res.output, reference_attention(index, keys, values, q, got),
                                   atol=1e-5, rtol=1e-5)
        assert torch.isfinite(res.lse).all()
        assert res.n_exact.tolist() == [index.num_steady + len(w) for w in want]
        pos = res.exact_positions[:, index.num_steady:]
        assert [[p - 4 for p in row if p >= 0] for row in pos.tolist()] == got
        seen["steps"] += 1
        seen["sizes"].add(index.num_indexed)

    # 300 steps: two update blocks (128 tokens) are inserted into the graph
    _run(index, 300, rng, keys, values, check, every=15)
    assert seen["steps"] == 20 and index.num_updates >= 2 and len(seen["sizes"]) >= 3
    index.free()
    assert index.meta_nbytes() == 0
    mgr.close()
    assert mgr.host_bytes() == 0


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_token_budget_reads_the_groups_best_of_their_searches(backend, rng):
    keys, values = _ints(rng, H, 900, D), torch.randn(H, 900, D, generator=rng)
    index = GraphIndex.build(keys, values, CFG.replace(kernel_backend=backend),
                             queries=_ints(rng, H * G, 64, D))
    index.set_token_budget(50)

    def check(index, keys, values, q):
        res = index.decode(q, SCALE)
        got = [[v for v in row if v >= 0] for row in res.selection.retrieval_ids.tolist()]
        want = reference_selection(index, keys, q, 50)
        assert [len(r) for r in got] == [50, 50]
        # ties in the summed softmax (fp32 here, fp64 there) may swap the last places
        overlap = sum(len(set(a) & set(b)) for a, b in zip(got, want, strict=True))
        assert overlap >= 0.95 * 100
        torch.testing.assert_close(res.output, reference_attention(index, keys, values, q, got),
                                   atol=1e-5, rtol=1e-5)

    _run(index, 40, rng, keys, values, check, every=4)


@pytest.mark.parametrize("how", ["top_k", "budget"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_full_budget_is_full_attention(how, dtype, backend, rng):
    cfg = CFG.replace(kernel_backend=backend)
    cfg = cfg.replace(graph_top_k=4096) if how == "top_k" else cfg
    keys = torch.randn(H, 700, D, generator=rng).to(dtype)
    values = torch.randn(H, 700, D, generator=rng).to(dtype)
    mgr = WaveBufferManager(cfg)
    index = GraphIndex.build(keys, values, cfg, queries=torch.randn(H * G, 50, D).to(dtype),
                             store=mgr.store("r", H, D, dtype, "cpu", layer="L"))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for s in range(150):  # through an update block
        if how == "budget":
            index.set_token_budget(index.num_indexed)
        if s % 10 == 0 or s > 140:
            q = torch.randn(H * G, D, generator=rng).to(dtype)
            out = index.decode(q, SCALE).output
            kk = keys.float().repeat_interleave(G, 0)
            vv = values.float().repeat_interleave(G, 0)
            p = torch.softmax(torch.einsum("hd,hnd->hn", q.float(), kk) * SCALE, dim=-1)
            torch.testing.assert_close(out.float(), torch.einsum("hn,hnd->hd", p, vv), **tol)
        nk = torch.randn(H, 1, D, generator=rng).to(dtype)
        nv = torch.randn(H, 1, D, generator=rng).to(dtype)
        index.append(nk, nv)
        keys, values = torch.cat([keys, nk], 1), torch.cat([values, nv], 1)
    assert index.num_updates >= 1
    index.free()
    mgr.close()
    assert mgr.host_bytes() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_equals_each_request_alone(dtype, rng):
    # three requests of different lengths in one layer, one leaving and one joining
    # mid-way, decoded by one fused call (decode_batch), against twins decoded alone
    cfg = CFG.replace(kernel_backend="auto")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    mgr = WaveBufferManager(cfg)

    def make(n, name):
        k, v = _ints(rng, H, n, D).to(dtype), torch.randn(H, n, D, generator=rng).to(dtype)
        q = _ints(rng, H * G, 40, D).to(dtype)
        return [GraphIndex.build(k, v, cfg, queries=q,
                                 store=mgr.store(f"{name}{twin}", H, D, dtype, "cpu", layer=lay))
                for twin, lay in ((0, "L"), (1, None))]

    live = [make(n, f"r{n}") for n in (60, 700, 1300)]  # the first too short to index
    for step in range(90):
        if step == 30:
            for i in live.pop(1):
                i.free()
        if step == 50:
            live.append(make(500, "late"))
        q = _ints(rng, len(live), H * G, D).to(dtype)
        out = decode_batch([p[0] for p in live], q, SCALE)
        for b, (_, twin) in enumerate(live):
            alone = twin.decode(q[b], SCALE)
            torch.testing.assert_close(out[b], alone.output, **tol)
        for pair in live:
            nk, nv = _ints(rng, H, 1, D).to(dtype), torch.randn(H, 1, D, generator=rng).to(dtype)
            for i in pair:
                i.append(nk, nv)
    for pair in live:
        for i in pair:
            i.free()
    mgr.close()
    assert mgr.host_bytes() == 0


def test_short_context_and_no_queries(rng):
    # too short to index: exact; no prefill queries: the graph is trained on the keys
    short = GraphIndex.build(torch.randn(H, 100, D), torch.randn(H, 100, D), CFG)
    assert short.is_dense and short.select_tokens(torch.randn(H * G, D), SCALE).shape == (H, 0)
    keys, values = torch.randn(H, 600, D, generator=rng), torch.randn(H, 600, D, generator=rng)
    index = GraphIndex.build(keys, values, CFG)
    assert index.spec is not None and index.spec.num_graphs == H
    res = index.decode(torch.randn(H * G, D, generator=rng), SCALE)
    assert torch.isfinite(res.output).all()
    per_head = GraphIndex.build(keys, values, CFG, queries=torch.randn(H * G, 30, D),
                                per_query_head=True)
    assert per_head.spec.num_graphs == H * G and per_head.adj.buf.shape[0] == H * G
    assert torch.isfinite(per_head.decode(torch.randn(H * G, D), SCALE).output).all()


@pytest.mark.parametrize("name,value,accepted", [
    ("graph_top_k", 0, r"\[1, 1048576\]"), ("graph_degree", 1, r"\[2, 256\]"),
    ("graph_search_ef", 0, r"\[1, 1048576\]"), ("graph_knn", 1, r"\[2, 4096\]"),
    ("graph_train_queries", 0, r"\[1, 4194304\]"), ("graph_block_tokens", 0, r"\[1, 65536\]"),
])
def test_bad_graph_options_name_the_value_and_range(name, value, accepted):
    with pytest.raises(ConfigError, match=rf"{name}={value} .*{accepted}"):
        RetroConfig(**{name: value})


def test_graph_is_an_index_choice_and_bad_queries_are_named():
    assert RetroConfig(index="graph").index == "graph"
    with pytest.raises(ValueError, match=r"queries of shape \(3, 10, 64\); accepted"):
        GraphIndex.build(torch.randn(H, 300, D), torch.randn(H, 300, D), CFG,
                         queries=torch.randn(3, 10, D))


def test_attention_on_real_qwen_data_near_the_exact_top_k(qwen_capture):
    # the same exact-token budget per KV head as the oracle (the exact top tokens by the
    # group's summed softmax): the graph's choice recovers most of the true top-100 and
    # the output error stays near the oracle's
    torch.set_num_threads(1)
    cfg = RetroConfig(index="graph", kernel_backend="torch", estimation_budget=0.0)
    scale = qwen_capture["scale"]
    for layer in (8, 15):
        d = qwen_capture["layers"][layer]
        train, q, pos = d["q"][:, :192], d["q"][:, -16:], d["positions"][-16:]

        def step(index, query, scale, i):
            index.set_token_budget(128)
            return index.decode(query, scale, return_positions=True)

        args = (q, d["k"], d["v"], pos, scale)
        graph = evaluate_policy(lambda k, v, t=train: GraphIndex.build(k, v, cfg, queries=t),
                                *args, step=step).summary()
        oracle = evaluate_policy(lambda k, v: OracleIndex.build(k, v, cfg), *args,
                                 step=step).summary()
        assert graph["recall_mean"] >= 0.9 * oracle["recall_mean"], (layer, graph, oracle)
        assert graph["rel_err_mean"] <= 1.25 * oracle["rel_err_mean"] + 0.01, (graph, oracle)
