"""vllm_retro.index: tripartite decode attention, zones, dense fallback, updates."""

import pytest
import torch

from tests.helpers import full_attention, rel_err
from vllm_retro.config import RetroConfig
from vllm_retro.index import WaveIndex, sparse_attention
from vllm_retro.kernels.scoring import cluster_scores_ref
from vllm_retro.kernels.tripartite_attention import log_tilt_ref

ALL = RetroConfig(retrieval_budget=1.0, estimation_budget=0.0)
NO_EST = RetroConfig(estimation_budget=0.0)
PAPER = RetroConfig(estimator="centroid")


def _qkv(hq, hkv, n, d, rng, dtype=torch.float32):
    q = torch.randn(hq, d, generator=rng)
    k = torch.randn(hkv, n, d, generator=rng) + 0.5 * torch.randn(hkv, 1, d, generator=rng)
    v = torch.randn(hkv, n, d, generator=rng)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("hq,hkv,n,d,seg", [
    (8, 2, 3000, 64, 8192), (4, 4, 2000, 128, 8192), (16, 1, 1500, 256, 8192),
    (14, 2, 5000, 64, 1024), (6, 2, 1200, 80, 8192), (2, 2, 1200, 32, 512),
])
def test_full_budget_equals_full_attention(hq, hkv, n, d, seg, rng):
    q, k, v = _qkv(hq, hkv, n, d, rng)
    out, stats = sparse_attention(q, k, v, ALL.replace(segment_size=seg))
    assert not stats["dense"] and stats["n_exact"] == [n] * hkv
    assert rel_err(out, full_attention(q, k, v)) < 1e-5


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (7, 7, 128), (4, 1, 256)])
def test_empty_estimation_equals_attention_over_chosen_tokens(hq, hkv, d, rng):
    q, k, v = _qkv(hq, hkv, 4000, d, rng)
    index = WaveIndex.build(k, v, NO_EST)
    res = index.decode(q, return_positions=True)
    pos = res.exact_positions
    # chosen = steady zone + every member of every retrieval cluster
    for h in range(hkv):
        got = set(pos[h][pos[h] >= 0].tolist())
        assert len(got) == int(res.n_exact[h])
        steady = set(range(4)) | set(range(4000 - 64, 4000))
        assert steady <= got
        members = set()
        for c in res.selection.retrieval_ids[h].tolist():
            members |= set(index.store.positions[h, index.store.offsets[h, c]:
                                                 index.store.offsets[h, c + 1]].tolist())
        assert got == steady | members
    assert rel_err(res.output, full_attention(q, k, v, positions=pos)) < 1e-5


def _paper_reference(index, res, q, k, v):
    """Eq. 2-4 in fp64 from the index's own meta data and chosen zones: [Hq, D]."""
    hq, d = q.shape
    g, scale = hq // index.num_kv_heads, d ** -0.5
    q, k, v = q.double(), k.double(), v.double()
    out = torch.empty(hq, d, dtype=torch.float64)
    for i in range(hq):
        h = i // g
        pos = res.exact_positions[h][res.exact_positions[h] >= 0]
        w = torch.exp(k[h, pos] @ q[i] * scale)
        num, den = w @ v[h, pos], w.sum()
        for c in res.selection.estimation_ids[h].tolist():
            we = torch.exp(index.centroids[h, c].double() @ q[i] * scale)
            num = num + we * index.value_sums[h, c].double()
            den = den + int(index.sizes[h, c]) * we
        out[i] = num / den
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.float32, 1e-5),
                                       (torch.float16, 1e-2), (torch.bfloat16, 2e-2)])
def test_estimation_zone_follows_the_paper(dtype, tol, rng):
    """Output = (exact tokens + sum_i exp(q.C_i) VS_i) / (their weights + sum_i s_i exp(q.C_i)),
    at default budgets, in every dtype, with ``estimator='centroid'``."""
    q, k, v = _qkv(4, 2, 3000, 64, rng, dtype)
    index = WaveIndex.build(k, v, PAPER)
    res = index.decode(q, return_positions=True)
    assert res.output.dtype == dtype and not res.output.isnan().any()
    assert rel_err(res.output, _paper_reference(index, res, q, k, v)) < tol


def _tilted_reference(index, res, q, k, v, rank=8):
    """The tilted estimator in fp64 from the clusters' members (not the index's statistics):
    spread, Blom deviate, pooled per-dimension variance share and rank-8 pooled value-key
    cross-covariance per KV head. [Hq, D]."""
    hq, d = q.shape
    hkv = index.num_kv_heads
    g, scale = hq // hkv, d ** -0.5
    q, k, v = q.double(), k.double(), v.double()
    st = index.store
    members, profile, pmat = {}, [], []
    for h in range(hkv):
        key_sq, cross = torch.zeros(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
        for c in range(index.num_clusters):
            pos = st.positions[h, st.offsets[h, c]:st.offsets[h, c + 1]]
            if len(pos):
                dk, dv = k[h, pos] - k[h, pos].mean(0), v[h, pos] - v[h, pos].mean(0)
                members[h, c] = (pos, float((dk * dk).sum(1).mean()))
                key_sq, cross = key_sq + (dk * dk).sum(0), cross + dv.T @ dk
        u, sv, vh = torch.linalg.svd(cross / key_sq.sum())
        profile.append(key_sq / key_sq.sum())
        pmat.append(u[:, :rank] @ torch.diag(sv[:rank]) @ vh[:rank])
    out = torch.empty(hq, d, dtype=torch.float64)
    normal = torch.distributions.Normal(0.0, 1.0)
    for i in range(hq):
        h = i // g
        pos = res.exact_positions[h][res.exact_positions[h] >= 0]
        w = torch.exp(k[h, pos] @ q[i] * scale)
        num, den = w @ v[h, pos], w.sum()
        qvar = scale ** 2 * float((q[i] ** 2) @ profile[h])
        vshift = scale * pmat[h] @ q[i]
        for c in res.selection.estimation_ids[h].tolist():
            if (h, c) not in members:
                continue
            cpos, spread = members[h, c]
            n = len(cpos)
            a = float(normal.icdf(torch.tensor((n - 0.375) / (n + 0.25)))) if n > 1 else 0.0
            lt = float(log_tilt_ref(torch.tensor(qvar * spread), torch.tensor(a)))
            we = n * torch.exp(k[h, cpos].mean(0) @ q[i] * scale + lt)
            num = num + we * (v[h, cpos].mean(0) + spread * vshift)
            den = den + we
        out[i] = num / den
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-4), (torch.float32, 1e-4),
                                       (torch.bfloat16, 3e-2)])
def test_tilted_estimation_zone_follows_its_model(dtype, tol, rng):
    """The default estimator: each estimated cluster weighted by n e^{q.C} e^{log_tilt} with
    the value shifted by spread * vshift, statistics recomputed here from the members."""
    q, k, v = _qkv(4, 2, 3000, 64, rng, dtype)
    index = WaveIndex.build(k, v, RetroConfig())
    res = index.decode(q, return_positions=True)
    assert res.output.dtype == dtype and not res.output.isnan().any()
    assert rel_err(res.output, _tilted_reference(index, res, q, k, v)) < tol
    assert rel_err(res.output, _paper_reference(index, res, q, k, v)) > 0.05  # it differs


def test_tilted_beats_the_paper_on_gaussian_keys(rng):
    """Where the model holds (Gaussian keys and values, values correlated with keys), the
    tilted estimate is closer to full attention than the paper's, query after query."""
    hq, hkv, n, d = 8, 2, 6000, 64
    mix = torch.randn(hkv, d, d, generator=rng) / d ** 0.5
    k = torch.randn(hkv, n, d, generator=rng) * 1.5
    v = k @ mix + 0.5 * torch.randn(hkv, n, d, generator=rng)
    tilted, paper = WaveIndex.build(k, v, RetroConfig()), WaveIndex.build(k, v, PAPER)
    wins, errs = 0, []
    for _ in range(12):
        q = torch.randn(hq, d, generator=rng) * 1.5
        ref = full_attention(q, k, v)
        et, ep = rel_err(tilted.decode(q).output, ref), rel_err(paper.decode(q).output, ref)
        wins += et < ep
        errs.append((et, ep))
    assert wins >= 11, errs
    assert sum(e for e, _ in errs) < 0.85 * sum(e for _, e in errs), errs


def test_estimators_agree_without_estimation_or_spread(rng):
    q, k, v = _qkv(4, 2, 3000, 64, rng)
    for cfg in (NO_EST, ALL):
        a = WaveIndex.build(k, v, cfg).decode(q).output
        b = WaveIndex.build(k, v, cfg.replace(estimator="centroid")).decode(q).output
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # every cluster a run of identical keys and values: zero spread, nothing to correct
    k = k[:, ::8].repeat_interleave(8, 1)[:, :3000].contiguous()
    v = v[:, ::8].repeat_interleave(8, 1)[:, :3000].contiguous()
    cfg = RetroConfig(cluster_size=8)
    a = WaveIndex.build(k, v, cfg)
    assert float(a.spreads.max()) < 1e-8
    torch.testing.assert_close(a.decode(q).output,
                               WaveIndex.build(k, v, cfg.replace(estimator="centroid"))
                               .decode(q).output, rtol=1e-5, atol=1e-5)


def test_zones_are_ranked_by_group_softmax(rng):
    hq, hkv, d = 8, 2, 64
    q, k, v = _qkv(hq, hkv, 6000, d, rng)
    cfg = RetroConfig()
    index = WaveIndex.build(k, v, cfg)
    sel = index.select(q, d ** -0.5)
    c = index.num_clusters
    r, e = cfg.num_retrieval(c), cfg.num_estimation(c)
    assert sel.retrieval_ids.shape == (hkv, r) and sel.estimation_ids.shape == (hkv, e)
    scores = cluster_scores_ref(q.reshape(hkv, -1, d), index.centroids, index.sizes, d ** -0.5)
    order = scores.argsort(dim=1, descending=True)
    for h in range(hkv):
        assert set(sel.retrieval_ids[h].tolist()) == set(order[h, :r].tolist())
        assert set(sel.estimation_ids[h].tolist()) == set(order[h, r:r + e].tolist())


def test_default_budget_counts(rng):
    q, k, v = _qkv(4, 2, 20000, 64, rng)
    _, stats = sparse_attention(q, k, v)
    c = stats["n_clusters"]
    assert c == sum(-(-n // 16) for n in (8192, 8192, 20000 - 68 - 2 * 8192))
    # the paper's 1.8% of 1246 clusters is 23: the floor of 32 binds at 20K tokens
    assert stats["n_retrieval_clusters"] == 32 == RetroConfig().min_retrieval_clusters
    _, paper = sparse_attention(q, k, v, RetroConfig(min_retrieval_clusters=0))
    assert paper["n_retrieval_clusters"] == -(-18 * c // 1000) == 23
    assert stats["n_estimated_clusters"] == -(-232 * c // 1000)
    assert 0.2 < stats["estimated_token_fraction"] < 0.27
    assert all(68 < x < 68 + 0.05 * 20000 for x in stats["n_exact"])


@pytest.mark.parametrize("n", [1, 5, 68, 500, 1091])
def test_short_contexts_are_dense_and_exact(n, rng):
    q, k, v = _qkv(8, 2, n, 64, rng)
    out, stats = sparse_attention(q, k, v)  # default budgets
    assert stats["dense"] and stats["n_clusters"] == 0 and stats["n_exact"] == [n, n]
    assert rel_err(out, full_attention(q, k, v)) < 1e-5


def test_threshold_is_the_first_indexed_length(rng):
    n = RetroConfig().min_indexed_context
    q, k, v = _qkv(2, 1, n, 64, rng)
    assert not sparse_attention(q, k, v)[1]["dense"]


@pytest.mark.parametrize("rounds", [0, 1, 3])
def test_updates_append_without_reclustering(rounds, rng):
    """Update blocks are appended to the index, never re-clustering earlier blocks; with
    ``update_rounds_per_step`` > 0 a due block is clustered over the next steps (its tokens
    stay in the window meanwhile) and lands with the very clusters the one-go path makes."""
    cfg = RetroConfig(update_rounds_per_step=rounds)
    hq, hkv, d, n0 = 4, 2, 64, 2000
    q, k, v = _qkv(hq, hkv, n0 + 2300, d, rng)
    index = WaveIndex.build(k[:, :n0], v[:, :n0], cfg)
    c0 = index.num_clusters
    cen0 = index.centroids.clone()
    updates = []
    lag = 0
    for t in range(n0, n0 + 2300):
        if index.append(k[:, t:t + 1], v[:, t:t + 1]):
            updates.append(t + 1)
        w = index.num_tokens - index.window_start
        in_flight = index._pending is not None or index.store_settling
        lag += in_flight
        assert cfg.local_window <= w < cfg.local_window + 2 * cfg.update_segment
        assert w < cfg.local_window + cfg.update_segment or in_flight
        assert index.num_tokens == t + 1
    # the window starts at n0 - 64 tokens; an update is due each time it reaches 64 + 1024
    first = (n0 - 64) + 64 + 1024
    if rounds == 0:
        assert updates == [first, first + 1024] and lag == 0
    else:  # due at the same steps, landing a few steps later (rounds, then one step in
        # the store)
        assert updates[0] - first in range(1, cfg.kmeans_iters + 3)
        assert updates[1] - (first + 1024) in range(1, cfg.kmeans_iters + 3) and lag > 0
    sync = WaveIndex.build(k[:, :n0], v[:, :n0], RetroConfig(update_rounds_per_step=0))
    for t in range(n0, n0 + 2300):
        sync.append(k[:, t:t + 1], v[:, t:t + 1])
    assert torch.equal(index.centroids, sync.centroids)  # the same clusters either way
    assert index.num_clusters == c0 + 2 * cfg.update_clusters
    assert torch.equal(index.centroids[:, :c0], cen0)  # earlier clusters untouched
    assert index.num_updates == 2
    exact = WaveIndex.build(k[:, :1], v[:, :1], ALL)
    exact.append(k[:, 1:n0 + 2300], v[:, 1:n0 + 2300])
    assert exact.num_updates > 0
    assert rel_err(exact.decode(q).output, full_attention(q, k, v)) < 1e-5
    index.config = ALL  # read everything: the appended clusters cover every token exactly once
    assert rel_err(index.decode(q).output, full_attention(q, k, v)) < 1e-5


def test_meta_bytes_follow_the_buffers_through_growth_and_free(rng):
    """meta_nbytes (asked for every live index at every engine step, so counted once per
    meta generation) always equals the bytes of the buffers held: after build, as update
    blocks grow them, and after free."""
    def held(index):
        return index.residuals.nbytes() + index.meta_rows.pool.nbytes()  # its own pool

    # small update blocks: the build's headroom (4 blocks) runs out within 1200 tokens
    cfg = RetroConfig(update_rounds_per_step=0, update_segment=128, update_clusters=8)
    hkv, d, n0 = 2, 64, 2000
    _, k, v = _qkv(4, hkv, n0 + 1200, d, rng)
    index = WaveIndex.build(k[:, :n0], v[:, :n0], cfg)
    seen = {index.meta_nbytes()}
    assert index.meta_nbytes() == held(index)
    for t in range(n0, n0 + 1200):
        index.append(k[:, t:t + 1], v[:, t:t + 1])
        assert index.meta_nbytes() == held(index), f"token {t}"
        seen.add(index.meta_nbytes())
    assert index.num_updates >= 5 and len(seen) > 1  # the buffers grew, and it followed
    index.free()
    assert index.meta_nbytes() == held(index) < min(seen)


def test_dense_context_becomes_indexed_as_it_grows(rng):
    q, k, v = _qkv(2, 2, 1200, 32, rng)
    index = WaveIndex.build(k[:, :100], v[:, :100])
    assert index.is_dense
    index.append(k[:, 100:], v[:, 100:])
    assert not index.is_dense and index.num_clusters == 64 and index.num_updates == 1
    assert index.num_steady == 4 + (1200 - 4 - 1024)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_half_precision(dtype, d, rng):
    q, k, v = _qkv(8, 2, 2500, d, rng, dtype)
    out, _ = sparse_attention(q, k, v, ALL)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, full_attention(q, k, v)) < 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_triton_backend_matches_torch_backend(dtype, tol, rng, triton_device):
    """The whole index (build: k-means assignment and sums; decode: scoring and tripartite
    attention) on the Triton kernels against the torch backend, in fp32 and in bf16 (16-bit
    operands on tensor cores on a GPU: only the order of fp32 sums differs)."""
    q, k, v = _qkv(8, 2, 3000, 64, rng, dtype)
    cfg = RetroConfig(kmeans_iters=3)
    out_t, st_t = sparse_attention(q, k, v, cfg.replace(kernel_backend="torch"))
    dev = [x.to(triton_device) for x in (q, k, v)]
    out_x, st_x = sparse_attention(*dev, cfg.replace(kernel_backend="triton"))
    assert st_t["n_clusters"] == st_x["n_clusters"]
    assert out_x.dtype == dtype and not out_x.isnan().any()
    assert rel_err(out_x.cpu(), out_t) < tol


def test_decode_phases_are_recorded_without_changing_the_output(rng):
    """``phases`` accumulates the time of each decode phase and changes nothing else."""
    k = torch.randn(2, 3000, 32, generator=rng)
    v = torch.randn(2, 3000, 32, generator=rng)
    index = WaveIndex.build(k, v, RetroConfig())
    q = torch.randn(4, 32, generator=rng)
    phases: dict[str, float] = {}
    a = index.decode(q, phases=phases)
    b = index.decode(q)
    assert torch.equal(a.output, b.output)
    assert list(phases) == ["select", "gather", "estimator", "attention", "bookkeeping"]
    assert all(t >= 0 for t in phases.values())
