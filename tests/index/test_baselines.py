"""Baseline selection policies (Quest, PQCache, StreamingLLM, exact top-k oracle) against
plain-torch references, at the shared exact-token budget."""

import pytest
import torch

from tests.helpers import full_attention, rel_err
from vllm_retro.config import RetroConfig
from vllm_retro.index import sparse_attention
from vllm_retro.index.baselines import (
    BASELINES,
    baseline_attention,
    retrieval_token_budget,
    streaming_attention,
)
from vllm_retro.index.compare import compare_all
from vllm_retro.index.pq import fit_pq, pq_decode, pq_encode, pq_logits
from vllm_retro.index.pq_index import PQIndex

METHODS = tuple(BASELINES)
CFG = RetroConfig(estimation_budget=0.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # small tensors: on a busy 2-core box, intra-op threads only add contention
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _qkv(hq, hkv, n, d, rng):
    q = torch.randn(hq, d, generator=rng)
    k = torch.randn(hkv, n, d, generator=rng) + 0.5 * torch.randn(hkv, 1, d, generator=rng)
    v = torch.randn(hkv, n, d, generator=rng)
    return q, k, v


def _decode(method, q, k, v, budget, config=CFG, **opts):
    index = BASELINES[method].build(k, v, config, **opts)
    index.set_token_budget(budget)
    return index, index.decode(q, return_positions=True)


def _read(res, h):
    pos = res.exact_positions[h]
    return set(pos[pos >= 0].tolist())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("hq,hkv,n,d", [(8, 2, 1500, 64), (4, 4, 1200, 128), (6, 2, 1300, 80)])
def test_full_budget_equals_full_attention(method, hq, hkv, n, d, rng):
    q, k, v = _qkv(hq, hkv, n, d, rng)
    out, stats = baseline_attention(method, q, k, v, token_budget=n)
    assert not stats["dense"] and stats["n_exact"] == [n] * hkv
    assert stats["n_estimated_clusters"] == 0
    assert rel_err(out, full_attention(q, k, v)) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_short_context_is_dense(method, rng):
    q, k, v = _qkv(4, 2, 300, 64, rng)
    out, stats = baseline_attention(method, q, k, v)
    assert stats["dense"] and stats["token_budget"] == 0
    assert rel_err(out, full_attention(q, k, v)) < 1e-5


def _reference_ranking(method, index, q, k, scale):
    """Plain-torch rank of every indexed token [H, M] (higher first) and its positions [M]."""
    hkv = k.shape[0]
    g = q.shape[0] // hkv
    sink, start = index.sink_k.shape[1], index.window_start
    pos = torch.arange(sink, start)
    kk = k[:, sink:start].double()
    qg = q.double().reshape(hkv, g, -1)
    if method == "streaming":
        return pos.double()[None].expand(hkv, -1), pos
    if method == "quest":  # pages of 16 by their min/max bound, spread over their tokens
        m = kk.shape[1]  # pages end at the window: the first one is the short one
        sizes = [m % 16 or 16] + [16] * ((m - 1) // 16)
        pages = kk.split(sizes, dim=1)
        lo = torch.stack([p.amin(1) for p in pages], 1)
        hi = torch.stack([p.amax(1) for p in pages], 1)
        logits = torch.maximum(qg[:, :, None] * lo[:, None], qg[:, :, None] * hi[:, None]).sum(-1)
        score = (logits * scale).softmax(-1).sum(1)  # [H, P]
        return score.repeat_interleave(torch.tensor(sizes), dim=1), pos
    if method == "pqcache":  # exact q . k_hat on the reconstructed keys
        kk = pq_decode(index.pq, pq_encode(index.pq, k[:, sink:start])).double()
    logits = torch.einsum("hgd,hnd->hgn", qg, kk) * scale
    return logits.softmax(-1).sum(1), pos


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [32, 96])
def test_selection_and_output_match_reference(method, budget, rng):
    q, k, v = _qkv(8, 2, 2000, 64, rng)
    index, res = _decode(method, q, k, v, budget)
    n, scale = 2000, 64 ** -0.5
    rank, pos = _reference_ranking(method, index, q, k, scale)
    steady = set(range(4)) | set(range(n - 64, n))
    for h in range(2):
        got = _read(res, h)
        assert len(got) == int(res.n_exact[h]) == len(steady) + budget
        if method == "pqcache":  # tokens with equal codes tie exactly: any may be last
            thr = rank[h].topk(budget).values[-1]
            sure = set(pos[rank[h] > thr * (1 + 1e-9)].tolist())
            able = set(pos[rank[h] >= thr * (1 - 1e-9)].tolist())
            assert steady | sure <= got <= steady | able, (method, h)
            continue
        top = pos[rank[h].topk(budget).indices]
        assert got == steady | set(top.tolist()), (method, h)
    assert torch.isfinite(res.output).all()
    assert rel_err(res.output, full_attention(q, k, v, positions=res.exact_positions)) < 1e-5


@pytest.mark.parametrize("budget,read", [(256, 256), (250, 256), (100, 96)])
def test_streaming_reads_exactly_sinks_and_widened_window(budget, read, rng):
    # whole 16-token pages next to the window: round(budget / 16) of them
    q, k, v = _qkv(4, 2, 1800, 64, rng)
    cfg = RetroConfig(sink_tokens=8, local_window=100)
    index, res = _decode("streaming", q, k, v, budget, cfg)
    want = set(range(8)) | set(range(1800 - 100 - read, 1800))
    assert _read(res, 0) == _read(res, 1) == want
    ref = full_attention(q, k, v, positions=torch.tensor(sorted(want))[None].expand(2, -1))
    out, stats = streaming_attention(q, k, v, budget, cfg)
    assert rel_err(out, ref) < 1e-5 and stats["n_exact"] == [len(want)] * 2


@pytest.mark.parametrize("method", ["pqcache", "oracle"])
def test_topk_picks_true_top_tokens_when_keys_are_well_separated(method, rng):
    """Keys are 24 well-separated prototypes plus tiny noise; one prototype (20 tokens
    scattered over the context) aligns with both query heads: exactly those are read."""
    hq, d, n = 4, 64, 2000
    q = torch.randn(hq, d, generator=rng)
    protos = 3 * torch.randn(2, 24, d, generator=rng)
    protos[:, 0] = 2 * q.reshape(2, 2, d).sum(1)  # KV head h serves query heads 2h, 2h+1
    which = torch.randint(1, 24, (2, n), generator=rng)
    hot = torch.randperm(n - 200, generator=rng)[:20] + 100
    which[:, hot] = 0
    k = torch.gather(protos, 1, which[..., None].expand(2, n, d))
    k = k + 0.01 * torch.randn(2, n, d, generator=rng)
    v = torch.randn(2, n, d, generator=rng)
    _, res = _decode(method, q, k, v, 20)
    steady = set(range(4)) | set(range(n - 64, n))
    for h in range(2):
        assert _read(res, h) == steady | set(hot.tolist())


def test_quest_picks_the_pages_of_the_top_tokens(rng):
    hq, d, n = 4, 64, 2000
    q, k, v = _qkv(hq, 2, n, d, rng)
    k = 0.1 * k
    # pages end at the window (1936): the first is 4..16, then 16-token pages from 16 on
    k[:, 320:352] = q.reshape(2, 2, d).sum(1)[:, None]  # two whole pages
    _, res = _decode("quest", q, k, v, 32)
    steady = set(range(4)) | set(range(n - 64, n))
    for h in range(2):
        assert _read(res, h) == steady | set(range(320, 352))


def test_pq_reconstruction_error_decreases_with_bits(rng):
    k = torch.randn(2, 1500, 64, generator=rng) + torch.randn(2, 1, 64, generator=rng)
    errs = []
    for bits in (1, 2, 4, 6, 8):
        pq = fit_pq(k, 2, bits, 10)
        errs.append(rel_err(pq_decode(pq, pq_encode(pq, k)), k))
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False)), errs
    more = fit_pq(k, 4, 6, 10)  # more sub-spaces, same bits: finer too
    assert rel_err(pq_decode(more, pq_encode(more, k)), k) < errs[3]


def test_pq_fit_on_a_sample_is_the_fit_of_those_keys(rng):
    """``sample`` bounds the keys the codebooks are trained on: evenly spaced ones, and the
    fit is exactly the fit of that subset (so its cost does not grow with the context)."""
    k = torch.randn(2, 5000, 64, generator=rng)
    sub = fit_pq(k, 2, 4, 5, sample=300)
    idx = torch.linspace(0, 4999, 300).long()
    assert torch.equal(sub.codebooks, fit_pq(k[:, idx], 2, 4, 5).codebooks)
    assert torch.equal(fit_pq(k[:, :200], 2, 4, 5, sample=300).codebooks,
                       fit_pq(k[:, :200], 2, 4, 5).codebooks)  # fewer keys: all of them


def test_pq_lookup_logits_equal_reconstructed_dot_products(rng):
    k = torch.randn(2, 700, 64, generator=rng)
    q = torch.randn(2, 3, 64, generator=rng)
    pq = fit_pq(k, 2, 6, 5)
    codes = pq_encode(pq, k)
    assert codes.shape == (2, 700, 2) and int(codes.max()) < 64
    ref = torch.einsum("hgd,hnd->hgn", q.double(), pq_decode(pq, codes).double())
    assert rel_err(pq_logits(pq, codes, q), ref) < 1e-5


def test_pq_degenerate_keys_stay_finite(rng):
    """All keys equal: k-means++ and empty codewords must not produce NaN."""
    k = torch.ones(2, 1400, 64)
    v = torch.randn(2, 1400, 64, generator=rng)
    q = torch.randn(4, 64, generator=rng)
    out, stats = baseline_attention("pqcache", q, k, v)
    assert torch.isfinite(out).all() and stats["token_budget"] > 0
    out, _ = baseline_attention("pqcache", q, k, v, 1400)
    assert rel_err(out, full_attention(q, k, v)) < 1e-5


@pytest.mark.parametrize("config", [
    RetroConfig(), RetroConfig(segment_size=1024), RetroConfig(retrieval_budget=0.05),
    RetroConfig(cluster_size=8, sink_tokens=16, local_window=128),
])
def test_budgets_are_equal_across_methods(config, rng):
    n = 4000
    q, k, v = _qkv(8, 2, n, 64, rng)
    _, wave = sparse_attention(q, k, v, config)
    n_indexed = n - wave["n_steady"]
    budget = retrieval_token_budget(config, n_indexed)
    # the rule is the wave index's retrieval clusters times its mean cluster size
    assert wave["n_retrieval_clusters"] == config.num_retrieval(wave["n_clusters"])
    assert budget == round(wave["n_retrieval_clusters"] * n_indexed / wave["n_clusters"])
    for method in METHODS:
        _, stats = baseline_attention(method, q, k, v, config=config)
        assert stats["token_budget"] == budget
        want = wave["n_steady"] + budget
        slack = 8 if method in ("quest", "streaming") else 0  # whole 16-token pages
        assert all(abs(x - want) <= slack for x in stats["n_exact"]), (method, stats)


def test_pq_codes_follow_decode_updates(rng):
    """Update blocks are encoded with the prefill's codebooks; full budget stays exact."""
    q, k, v = _qkv(4, 2, 2300, 64, rng)
    index = PQIndex.build(k[:, :1200], v[:, :1200], CFG)
    pq = index.pq
    assert index.append(k[:, 1200:], v[:, 1200:])
    assert index.pq is pq and index.num_updates == 1
    assert index.codes.shape[1] == index.num_indexed == index.num_tokens - index.num_steady
    index.set_token_budget(2300)
    res = index.decode(q)
    assert rel_err(res.output, full_attention(q, k, v)) < 1e-5


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: baseline_attention("h2o", q, k, v), r"method='h2o'; accepted: quest"),
    (lambda q, k, v: baseline_attention("oracle", q, k, v, -1), r"token_budget=-1"),
    (lambda q, k, v: baseline_attention("oracle", q, k, v, scale=0), r"scale=0 is invalid"),
    (lambda q, k, v: baseline_attention("pqcache", q, k, v, subspaces=3), r"subspaces=3"),
    (lambda q, k, v: baseline_attention("pqcache", q, k, v, bits=0), r"bits=0"),
])
def test_bad_arguments(call, match, rng):
    q, k, v = _qkv(4, 2, 200, 64, rng)
    with pytest.raises(ValueError, match=match):
        call(q, k, v)


def test_compare_all_runs_every_policy_at_one_budget(rng):
    """The attention-level comparison on synthetic data: every method's retrieved tokens
    match the wave index's per step, and metrics are finite."""
    n, nq = 1400, 6
    q, k, v = _qkv(4, 2, n, 64, rng)
    queries = torch.randn(4, nq, 64, generator=rng)
    res = compare_all(queries, k, v, torch.arange(n - nq, n), 64 ** -0.5)
    assert set(res) == {"wave", "wave_centroid", "wave_no_estimation", "graph", *METHODS}
    wave = res["wave"].retrieved_tokens
    for name, acc in res.items():
        slack = 8 if name in ("quest", "streaming") else 0.5  # whole 16-token pages
        assert (acc.retrieved_tokens - wave).abs().max() <= slack, name
        assert torch.isfinite(acc.rel_err).all() and torch.isfinite(acc.recall).all()
    assert res["oracle"].recall.mean() >= res["streaming"].recall.mean()


@pytest.mark.real_model
def test_real_data_wave_index_beats_baselines_at_equal_budget(qwen_capture):
    """Qwen2.5-Coder-0.5B, 4096 prose tokens, the last 16 decode queries of layers 8, 15
    and 22 (the bench runs all captured layers): at the same exact-token budget the wave
    index beats PQCache, Quest and StreamingLLM, and the exact top-k oracle has the best
    recall."""
    err, recall = {}, {}
    for layer in (8, 15, 22):
        d = qwen_capture["layers"][layer]
        res = compare_all(d["q"][:, -16:], d["k"], d["v"], d["positions"][-16:],
                          qwen_capture["scale"])
        for name, acc in res.items():
            s = acc.summary()
            err.setdefault(name, []).append(s["rel_err_mean"])
            recall.setdefault(name, []).append(s["recall_mean"])
    mean_err = {name: sum(v) / len(v) for name, v in err.items()}
    for name in ("quest", "pqcache", "streaming"):
        assert mean_err["wave"] < 0.85 * mean_err[name], (name, mean_err)
        assert all(o > b for o, b in zip(recall["oracle"], recall[name], strict=True)), name
    assert all(o >= w for o, w in zip(recall["oracle"], recall["wave"], strict=True))
