"""vllm_retro.index.estimator_choice: ``estimator='auto'``, each KV head's estimator judged at
build time on the prompt's last queries."""

import torch

from tests.helpers import full_attention, rel_err
from vllm_retro.config import RetroConfig
from vllm_retro.index import WaveIndex
from vllm_retro.index.clustering import cluster_block
from vllm_retro.index.estimator_choice import (
    JUDGE_QUERIES,
    choose_tilted_heads,
    estimator_errors,
    token_clusters,
)

TILTED, CENTROID, AUTO = (RetroConfig(estimator=e) for e in ("tilted", "centroid", "auto"))


def _kv(hkv, n, d, rng):
    k = torch.randn(hkv, n, d, generator=rng) * 1.5 + torch.randn(hkv, 1, d, generator=rng)
    v = k @ (torch.randn(hkv, d, d, generator=rng) / d ** 0.5) \
        + 0.5 * torch.randn(hkv, n, d, generator=rng)
    return k, v


def test_token_clusters_inverts_the_cluster_contiguous_layout(rng):
    k, v = _kv(2, 1500, 32, rng)
    cl = cluster_block(k, v, 512, None, 16, 3, backend="torch")
    labels = token_clusters(cl)
    assert labels.shape == (2, 1500) and (labels >= 0).all()
    for h in range(2):
        for c in (0, 7, cl.num_clusters - 1):
            members = cl.order[h, cl.offsets[h, c]:cl.offsets[h, c + 1]]
            assert (labels[h, members] == c).all()
            assert int((labels[h] == c).sum()) == int(cl.sizes[h, c])


def test_a_head_set_to_centroid_decodes_exactly_as_the_centroid_estimator(rng):
    """The masking trick: zero terms on a head are the paper's estimator there, exactly, and
    the tilted estimator on the other heads, exactly (the same clusters: builds are
    deterministic)."""
    hq, hkv, n, d = 8, 4, 4000, 64
    k, v = _kv(hkv, n, d, rng)
    tilted, centroid = WaveIndex.build(k, v, TILTED), WaveIndex.build(k, v, CENTROID)
    mixed = WaveIndex.build(k, v, AUTO)  # no queries: every head tilted
    assert mixed.residuals.tilted_heads.all()
    keep = torch.tensor([True, False, False, True])
    mixed.residuals.set_tilted_heads(keep)
    group = hq // hkv
    for _ in range(3):
        q = torch.randn(hq, d, generator=rng) * 1.5
        got = mixed.decode(q).output.view(hkv, group, d)
        want_t = tilted.decode(q).output.view(hkv, group, d)
        want_c = centroid.decode(q).output.view(hkv, group, d)
        assert not torch.allclose(want_t, want_c, atol=1e-3)  # the estimators differ here
        torch.testing.assert_close(got[keep], want_t[keep], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[~keep], want_c[~keep], rtol=1e-5, atol=1e-6)


def test_the_choice_holds_for_blocks_added_while_decoding(rng):
    """A decode-time update block refreshes the residual model; a centroid head stays so."""
    hkv, d = 2, 32
    k, v = _kv(hkv, 2000, d, rng)
    cfg = AUTO.replace(update_segment=256, local_window=32)
    index = WaveIndex.build(k, v, cfg)
    index.residuals.set_tilted_heads(torch.tensor([False, True]))
    before = index.num_clusters
    extra_k, extra_v = _kv(hkv, 600, d, rng)
    for i in range(600):
        index.append(extra_k[:, i:i + 1], extra_v[:, i:i + 1])
    assert index.num_clusters > before  # update blocks landed
    assert (index.residuals.profile[0] == 0).all() and (index.residuals.value_factor[0] == 0).all()
    assert (index.residuals.profile[1] > 0).any()


def test_auto_keeps_per_head_the_estimator_closer_to_exact_on_its_queries(rng):
    """With the prompt's last queries, each head keeps the estimator whose error over the
    indexed tokens is the smaller on those queries; the judge's errors are the two
    estimators' decode errors (a one-token window, which the judge leaves out, aside)."""
    hq, hkv, n, d = 8, 2, 3000, 64
    k, v = _kv(hkv, n, d, rng)
    queries = torch.randn(hq, 20, d, generator=rng) * 1.5
    bare = RetroConfig(sink_tokens=0, local_window=1, estimator="auto")
    index = WaveIndex.build(k, v, bare)  # no queries: every head tilted
    mk, mv = k[:, :n - 1], v[:, :n - 1]  # the indexed tokens
    cl = cluster_block(mk, mv, bare.segment_size, None, bare.cluster_size, bare.kmeans_iters,
                       backend="torch", tol=bare.kmeans_tol)
    assert torch.equal(cl.sizes, index.sizes)  # the build's clustering
    err_t, err_c = estimator_errors(index, queries[:, -JUDGE_QUERIES:], mk, mv,
                                    token_clusters(cl), d ** -0.5)
    tilted = WaveIndex.build(k, v, bare.replace(estimator="tilted"))
    centroid = WaveIndex.build(k, v, bare.replace(estimator="centroid"))
    group = hq // hkv
    want_t, want_c = torch.zeros(hkv), torch.zeros(hkv)
    for t in range(20 - JUDGE_QUERIES, 20):
        q = queries[:, t]
        ref = full_attention(q, k, v).view(hkv, group, d)
        for want, idx in ((want_t, tilted), (want_c, centroid)):
            out = idx.decode(q).output.view(hkv, group, d)
            want += ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).mean(1) / JUDGE_QUERIES
    torch.testing.assert_close(err_t, want_t, rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(err_c, want_c, rtol=2e-2, atol=1e-4)
    chosen = choose_tilted_heads(index, queries, mk, mv, cl, d ** -0.5)
    assert torch.equal(chosen, err_t <= err_c)
    built = WaveIndex.build(k, v, bare, judge_queries=queries)
    assert torch.equal(built.residuals.tilted_heads, chosen)
    q = queries[:, -1]
    assert rel_err(built.decode(q).output, full_attention(q, k, v)) < 0.5
