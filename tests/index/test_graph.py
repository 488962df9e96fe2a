"""The graph index's algorithms (:mod:`vllm_retro.index.graph`): the C++ kernels against
their plain-Python references (exactly, on keys whose dot products are exact), the group
merge against its reference, the graph's reachability, and recall on real Qwen2.5 data,
where the query-trained graph beats the key-trained one (the paper's OOD argument)."""

from __future__ import annotations

import pytest
import torch

from vllm_retro.index import graph as gr
from vllm_retro.kernels import graph_cpu

needs_kernels = pytest.mark.skipif(graph_cpu.load() is None,
                                   reason=f"graph kernels unavailable: {graph_cpu.load_error()}")


def _small_ints(gen: torch.Generator, *shape: int, lo: int = -3, hi: int = 4) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen).float()


def _reachable(adj: torch.Tensor, entries: list[int], n: int) -> int:
    seen, todo = set(), [e for e in entries if 0 <= e < n]
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        todo += [v for v in adj[u].tolist() if v >= 0 and v not in seen]
    return len(seen)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cosine", [False, True])
def test_build_search_insert_equal_their_references(rng, dtype, cosine):
    # small integers (inner products) or +-1 entries over D = 16 (cosines in 1/16 steps):
    # every similarity is exact in both, so ties occur and must break alike (lower id)
    ext = graph_cpu.load()
    n, d, m, ef = 260, 16, 6, 12
    keys = (_small_ints(rng, n, d, lo=0, hi=2) * 2 - 1 if cosine else _small_ints(rng, n, d))
    queries = _small_ints(rng, 90, d) + 1
    inv = gr.inverse_norms(keys)[None] if cosine else None
    unit = gr.unit_keys(keys, torch.arange(n)[None], inv, 0)
    n_old = 200  # the first n_old keys built from queries, the rest inserted after
    knn = gr.exact_knn(queries, keys[:n_old], 20)
    entries = gr.entry_points(keys[:n_old], knn, 3)
    want = torch.full((n, 2 * m), -1, dtype=torch.int32)
    want[:n_old] = gr.build_ref(unit[:n_old], knn, entries, m, ef)
    pool, rows = keys.to(dtype), torch.arange(n)[None]
    got = torch.full((1, n, 2 * m), -1, dtype=torch.int32)
    inv_old = None if inv is None else inv[:, :n_old].contiguous()
    got[:, :n_old] = ext.graph_build(pool, rows[:, :n_old].contiguous(), knn[None].contiguous(),
                                     torch.tensor([0]), torch.tensor([entries]), m, ef, inv_old)
    assert torch.equal(got[0], want)
    assert (want[:n_old] >= 0).sum(1).min() >= 1
    gr.insert_ref(unit, want, n_old, entries, m, ef)
    ext.graph_insert(got, pool, rows, torch.tensor([0]), torch.tensor([entries]), n_old, n, m,
                     ef, inv)
    assert torch.equal(got[0], want)
    assert _reachable(want, entries, n) == n
    for _ in range(20):
        q = _small_ints(rng, d)
        found, _, scored = gr.search_ref(keys, want, entries, q, 24)
        ids, sims, counts = ext.graph_search([q[None]], [got], [pool], [rows],
                                             [torch.tensor([entries])], 24)[0]
        assert ids[0].tolist() == [v for _, v in found]
        assert sims[0].tolist() == [s for s, _ in found] and int(counts[0]) == scored


@needs_kernels
def test_search_on_gaussian_keys_agrees_with_the_reference(rng):
    # fp32 scores in the kernel, fp64 in the reference: the pools agree unless two scores
    # are within rounding of each other at a decisive comparison
    n, d, hq = 2000, 32, 4
    keys = torch.randn(1, n, d, generator=rng)
    queries = torch.randn(hq, 300, d, generator=rng)
    spec = gr.GraphSpec.make(1, hq, False)
    knn, ent = gr.build_inputs(keys, queries, spec, 50, 1000)
    rows = torch.arange(n)[None]
    inv = gr.inverse_norms(keys)
    adj = gr.build_graphs(keys[0], rows, knn, spec.graph_head, ent, 8, 32, inv)
    assert _reachable(adj[0], ent[0].tolist(), n) == n
    q = torch.randn(32, hq, d, generator=rng)
    res = gr.search_graphs(list(q), [adj] * 32, [keys[0]] * 32, [rows] * 32, [ent] * 32, 40)
    same = 0
    for b in range(32):
        for j in range(hq):
            found, _, _ = gr.search_ref(keys[0], adj[0], ent[0].tolist(), q[b, j], 40)
            same += res[b][0][j].tolist() == [v for _, v in found]
    assert same >= 0.97 * 32 * hq


def test_merge_group_equals_its_reference(rng):
    hk, g, p, n, d = 3, 4, 10, 50, 8
    pool = torch.randn(hk * n, d, generator=rng)
    rows = torch.arange(hk * n).reshape(hk, n)
    ids = torch.stack([torch.stack([torch.randperm(n, generator=rng)[:p] for _ in range(g)])
                       for _ in range(hk)])
    ids[0, 1, 7:] = -1  # a head that found fewer nodes
    ids[1] = ids[1, :1]  # a group whose heads all found the same ones
    queries = torch.randn(hk, g, d, generator=rng)
    for per_head, budget in ((4, None), (10, None), (6, 9), (3, 100)):
        got = gr.merge_group(ids, queries, pool, rows, 0.3, per_head, budget)
        want = gr.merge_group_ref(ids, queries, pool, rows, 0.3, per_head, budget)
        assert [[v for v in r if v >= 0] for r in got.tolist()] == want
        members = [{v for j in range(g) for v in ids[h, j, :per_head].tolist() if v >= 0}
                   for h in range(hk)]
        for h in range(hk):
            if budget is None:
                assert set(want[h]) == members[h]  # each head's own top-k, nothing else
            else:
                assert len(want[h]) == min(budget, len({v for v in ids[h].flatten().tolist()
                                                         if v >= 0}))


def test_training_queries_and_entries():
    q = torch.arange(10.0)[:, None]
    assert gr.training_queries(q, 4).flatten().tolist() == [0.0, 3.0, 6.0, 9.0]
    assert gr.training_queries(q, 20).shape[0] == 10
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [5.0, 5.0]])
    knn = torch.tensor([[3, 0], [3, 1], [1, 0], [0, 1]], dtype=torch.int32)
    # the key nearest the mean first, then top-1s by frequency (3 twice, 1 and 0 once)
    assert gr.entry_points(keys, knn, 3) == [2, 3, 0]
    spec = gr.GraphSpec.make(2, 6, False)
    qs = torch.arange(6.0)[:, None, None].expand(6, 2, 1)
    assert spec.queries_of(qs, 1).flatten().tolist() == [3.0, 3.0, 4.0, 4.0, 5.0, 5.0]
    assert gr.GraphSpec.make(2, 6, True).graph_head.tolist() == [0, 0, 0, 1, 1, 1]


def _recall(keys: torch.Tensor, train: torch.Tensor | None, test: torch.Tensor, ef: int
            ) -> float:
    """Mean recall@100 of the decode queries ``test`` ([Hq, T, D]) on graphs over
    ``keys`` ([Hk, N, D]) trained on ``train`` (None: the keys)."""
    hk, n, d = keys.shape
    hq = test.shape[0]
    spec = gr.GraphSpec.make(hk, hq, False)
    knn, ent = gr.build_inputs(keys, train, spec, 100, 4096)
    pool, rows = keys.reshape(-1, d), torch.arange(hk * n).reshape(hk, n)
    adj = gr.build_graphs(pool, rows, knn, spec.graph_head, ent, 16, 64, gr.inverse_norms(keys))
    for h in range(hk):
        assert _reachable(adj[h], ent[h].tolist(), n) == n
    g = hq // hk
    exact = torch.einsum("hgtd,hnd->hgtn", test.reshape(hk, g, -1, d), keys).topk(100, -1)[1]
    res = gr.search_graphs(list(test.permute(1, 0, 2)), [adj] * test.shape[1], [pool] *
                           test.shape[1], [rows] * test.shape[1], [ent] * test.shape[1], ef)
    hits = 0.0
    for t, (ids, _, _) in enumerate(res):
        top = ids[:, :100].reshape(hk, g, 100)
        hits += (top[..., :, None] == exact[:, :, t, None, :]).any(-1).float().mean().item()
    return hits / test.shape[1]


@needs_kernels
def test_recall_on_real_qwen_data_and_the_query_trained_graph_beats_the_key_graph(
        qwen_capture):
    # the capture's queries: 192 prefill queries (the last chunk before the decode) train
    # the graphs; the last 64 are the decode queries
    torch.set_num_threads(1)
    by_queries, by_keys = [], []
    for layer, d in qwen_capture["layers"].items():
        keys = d["k"][:, 4:4032 - 64].contiguous()  # the indexed part of a 4032-token prefill
        train, test = d["q"][:, :192], d["q"][:, 192:]
        by_queries.append(_recall(keys, train, test, 128))
        by_keys.append(_recall(keys, None, test, 128))
        assert by_queries[-1] >= 0.9, (layer, by_queries[-1])
    mean_q, mean_k = sum(by_queries) / len(by_queries), sum(by_keys) / len(by_keys)
    assert mean_q >= mean_k + 0.02, (by_queries, by_keys)
