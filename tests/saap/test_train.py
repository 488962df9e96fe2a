"""SAAP's training pieces against brute-force references: the spherical k-means, the
attention mass per bucket (eq. 1's ``A H_k``) with the long-range rules, the classifier and
its held-out measures."""

from __future__ import annotations

import pytest
import torch

from vllm_retro.index.saap_model import rope
from vllm_retro.saap import train


@pytest.fixture(autouse=True)
def one_thread():
    """Training runs on one thread, as calibrate does (small products: faster than two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_fit_centroids_is_a_spherical_kmeans_of_centred_keys():
    gen = torch.Generator().manual_seed(0)
    # four well separated directions around a large common offset (like a k_proj bias)
    dirs = torch.nn.functional.normalize(torch.randn(4, 16, generator=gen), dim=-1)
    pick = torch.randint(0, 4, (2, 800), generator=gen)
    keys = 50 + dirs[pick] * 5 + 0.05 * torch.randn(2, 800, 16, generator=gen)
    mean, cent = train.fit_centroids(keys, 4, 100, gen)
    torch.testing.assert_close(mean, keys.mean(1))
    torch.testing.assert_close(cent.norm(dim=-1), torch.ones(2, 4))
    got = train.assign_keys(keys, mean, cent)
    x = torch.nn.functional.normalize(keys - mean[:, None], dim=-1)
    # every key in the bucket of its most similar centroid (cosine of the centred key)
    assert torch.equal(got, (x @ cent.transpose(1, 2)).argmax(-1))
    # a fixed point: every centroid is its members' normalised mean
    for h in range(2):
        for c in got[h].unique():
            want = torch.nn.functional.normalize(x[h][got[h] == c].sum(0), dim=0)
            torch.testing.assert_close(cent[h, c], want, atol=1e-5, rtol=1e-5)


def _reference_mass(q, q_pos, k, buckets, c, inv_freq, scale, pairs):
    """Loops over queries and keys: softmax of post-RoPE logits over every causal key
    (``far``: its share on keys >= min_distance back, sinks aside), then over the far keys
    alone, summed per bucket; long-range when the top key (sinks aside) is far enough."""
    hq, s, _ = q.shape
    hkv, t, _ = k.shape
    g = hq // hkv
    kr = rope(k, torch.arange(t), inv_freq).double()
    mass = torch.zeros(hq, s, c, dtype=torch.float64)
    far_share = torch.zeros(hq, s, dtype=torch.float64)
    long_range = torch.zeros(hq, s, dtype=torch.bool)
    for h in range(hq):
        for i in range(s):
            p = int(q_pos[i])
            qr = rope(q[h, i][None], q_pos[i:i + 1], inv_freq)[0].double()
            logit = kr[h // g, :p + 1] @ qr * scale
            full = torch.softmax(logit, 0)
            far = [j for j in range(p + 1)
                   if j >= pairs.sink_tokens and p - j >= pairs.min_distance]
            far_share[h, i] = full[far].sum()
            non_sink = range(pairs.sink_tokens, p + 1)
            if non_sink:
                top = max(non_sink, key=lambda j: float(logit[j]))
                long_range[h, i] = p - top >= pairs.min_query_distance
            if far:
                pf = torch.softmax(logit[far], 0)
                for w, j in zip(pf, far, strict=True):
                    mass[h, i, buckets[h // g, j]] += w
    return mass, long_range, far_share


def test_bucket_mass_matches_a_brute_force_reference():
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, t, c = 4, 2, 16, 120, 5
    q, k = torch.randn(hq, 9, d, generator=gen) * 2, torch.randn(hkv, t, d, generator=gen) * 2
    pos = torch.tensor([0, 3, 10, 40, 41, 70, 99, 110, 119])
    buckets = torch.randint(0, c, (hkv, t), generator=gen)
    inv = 1.0 / 100.0 ** (torch.arange(0, d, 2).float() / d)
    pairs = train.Pairs(sink_tokens=2, min_distance=8, min_query_distance=12)
    mass, lr, share, far = train.bucket_mass(q, pos, k, buckets, c, inv, 1.0, 0.25, pairs,
                                             chunk=4)
    want, want_lr, want_far = _reference_mass(q, pos, k, buckets, c, inv, 0.25, pairs)
    torch.testing.assert_close(mass.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(far.double(), want_far, atol=1e-5, rtol=1e-5)
    assert torch.equal(lr, want_lr)
    assert mass[:, :2].sum() == 0  # nothing far enough yet
    # the key share: per query, the fraction of the far keys in each bucket
    for i, p in enumerate(pos.tolist()):
        far_keys = [j for j in range(p + 1) if j >= 2 and p - j >= 8]
        if far_keys:
            counts = torch.bincount(buckets[0, far_keys], minlength=c).float()
            torch.testing.assert_close(share[0, i], counts / len(far_keys))


def test_the_classifier_learns_the_bucket_distribution():
    # queries in 3 clusters, each pointing its attention at one bucket: the trained f_q
    # puts most probability on it; batch norm statistics are the training set's
    gen = torch.Generator().manual_seed(2)
    h, n, d, c = 2, 600, 8, 6
    centers = torch.randn(3, d, generator=gen) * 3
    which = torch.randint(0, 3, (h, n), generator=gen)
    x = centers[which] + 0.3 * torch.randn(h, n, d, generator=gen)
    y = torch.full((h, n, c), 0.02)
    y.scatter_(2, (which * 2)[..., None], 0.9)
    counts = torch.tensor([n, n - 100])
    losses: list[float] = []
    clf = train.train_classifier(x, y, counts, 32, 150, 64, 1e-2, gen,
                                 on_step=lambda _s, loss: losses.append(loss))
    assert not clf.training and losses[-1] < 0.6 * losses[0]
    with torch.no_grad():
        top = clf(x).argmax(-1)
        z = clf.hidden_pre(x)
    assert (top[0] == which[0] * 2).float().mean() > 0.95
    torch.testing.assert_close(clf.bn_mean[1], z[1, :n - 100].mean(0), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(clf.bn_var[1], z[1, :n - 100].var(0, unbiased=False),
                               atol=1e-3, rtol=1e-4)
    assert set(clf.tensors()) == {"w1", "b1", "bn_weight", "bn_bias", "bn_mean", "bn_var",
                                  "w2", "b2"}


def test_weighted_loss_follows_the_weights():
    # two contradicting labels for the same input: the heavier one wins
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 200, 4, generator=gen).repeat(1, 2, 1)
    y = torch.zeros(1, 400, 3)
    y[0, :200, 0] = 1
    y[0, 200:, 2] = 1
    w = torch.cat([torch.full((200,), 0.1), torch.ones(200)])[None]
    clf = train.train_classifier(x, y, torch.tensor([400]), 16, 100, 64, 1e-2, gen, w)
    with torch.no_grad():
        assert (clf(x[:, :200]).argmax(-1) == 2).float().mean() > 0.9


def test_quality_measures_order():
    gen = torch.Generator().manual_seed(4)
    hq, hkv, s, d, c = 4, 2, 50, 8, 10
    clf = train.Classifier(hkv, d, 16, c, gen).eval()
    cent = torch.nn.functional.normalize(torch.randn(hkv, c, d, generator=gen), dim=-1)
    q = torch.randn(hq, s, d, generator=gen)
    mass = torch.softmax(3 * torch.randn(hq, s, c, generator=gen), -1)
    share = torch.full((hq, s, c), 1 / c)
    far = torch.rand(hq, s, generator=gen)
    lr = torch.rand(hq, s, generator=gen) > 0.5
    qc = train.evaluate(clf, cent, q, mass, share, lr, far, 3)
    out = qc.summary()
    assert out["queries"] == int(lr.sum())
    assert out["recall_oracle"] >= max(out["recall_saap"], out["recall_kmeans"])
    assert out["served_oracle"] >= max(out["served_saap"], out["served_kmeans"])
    torch.testing.assert_close(torch.tensor(out["selectivity"]), torch.tensor(0.3))
    every = train.evaluate(clf, cent, q, mass, share, lr, far, c).summary()
    assert abs(every["recall_saap"] - 1) < 1e-5 and abs(every["served_saap"] - 1) < 1e-5
    both = train.QualityCounts()
    both.add(qc)
    both.add(qc)
    assert both.summary() == {**out, "queries": 2 * out["queries"]}
