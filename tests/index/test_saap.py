"""SAAP as a serving index: its bucket assignment, query routing and output against a
plain-torch reference written from the paper (Mazaré et al., 2025), on random and real data;
every bucket is full attention; bad options; freed memory."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import batched_equals_alone, decode_steps
from vllm_retro.buffer.manager import WaveBufferManager
from vllm_retro.config import ConfigError, RetroConfig
from vllm_retro.index.saap import SaapIndex
from vllm_retro.index.saap_model import (
    ModelIdentity,
    SaapFileError,
    SaapModel,
    layer_number,
    load_saap,
    random_saap_model,
)

H, G, D, C, F = 2, 4, 64, 32, 48
IDENTITY = ModelIdentity("test", 3, H * G, H, D, 10000.0, "0123456789abcdef")
CFG = RetroConfig(kernel_backend="torch", sink_tokens=4, local_window=32, update_segment=128,
                  saap_probes=5, cache_fraction=0.1)


def model(seed: int = 0, **kw) -> SaapModel:
    return random_saap_model(IDENTITY, C, F, torch.Generator().manual_seed(seed), **kw)


# ---------------------------------------------------------------------- the reference

def ref_derope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (Su et al.) rotates dimension pair (i, i + D/2) by ``pos * theta^(-2i/D)``
    (the half-split convention of Llama/Qwen in transformers); undo it as a complex
    multiplication by ``exp(-i pos w_i)``. x: [..., M, D] -> float64."""
    d = x.shape[-1]
    w = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
    z = z * torch.exp(-1j * positions.double()[:, None] * w[None, :])
    return torch.cat([z.real, z.imag], dim=-1)


def ref_buckets(m: SaapModel, layer: int, keys: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
    """Paper §4: a key's bucket is its nearest centroid of the (spherical) k-means of
    de-RoPEd keys -- here centred on the training keys' mean. keys [H, M, D] -> [H, M]."""
    x = ref_derope(keys, positions, m.identity.rope_theta) - m.tensors["key_mean"][layer][
        :, None].double()
    cos = torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(
        m.tensors["centroids"][layer].double(), dim=-1).transpose(1, 2)
    return cos.argmax(-1)


def ref_bucket_scores(m: SaapModel, layer: int, query: torch.Tensor, position: int
                      ) -> torch.Tensor:
    """Paper §4-5: the query classifier -- two linear layers, batch norm (inference: its
    running statistics), ReLU -- gives a distribution over buckets per query; a GQA group's
    distributions are summed. query [H * G, D] -> [H, C] float64."""
    h_kv, d = m.identity.num_kv_heads, query.shape[1]
    q = ref_derope(query.reshape(h_kv, -1, d), torch.tensor([position]), m.identity.rope_theta)
    with torch.no_grad():
        return torch.stack([torch.softmax(mlp(q[h]), dim=-1).sum(0)
                            for h, mlp in enumerate(ref_classifiers(m, layer))])


_MLPS: dict[tuple[int, int], list[torch.nn.Module]] = {}


def ref_classifiers(m: SaapModel, layer: int) -> list[torch.nn.Module]:
    """The paper's Q-model per KV head (appendix A, §6.1): Linear -> BatchNorm -> ReLU ->
    Linear, in eval mode, loaded with the file's weights (float64)."""
    key = (id(m), layer)
    if key not in _MLPS:
        t = m.tensors
        d, f, c = m.identity.head_dim, m.hidden, m.num_buckets
        mlps = []
        for h in range(m.identity.num_kv_heads):
            mlp = torch.nn.Sequential(torch.nn.Linear(d, f),
                                      torch.nn.BatchNorm1d(f, eps=m.bn_eps), torch.nn.ReLU(),
                                      torch.nn.Linear(f, c)).double().eval()
            with torch.no_grad():
                mlp[0].weight.copy_(t["w1"][layer, h])
                mlp[0].bias.copy_(t["b1"][layer, h])
                mlp[1].weight.copy_(t["bn_weight"][layer, h])
                mlp[1].bias.copy_(t["bn_bias"][layer, h])
                mlp[1].running_mean.copy_(t["bn_mean"][layer, h])
                mlp[1].running_var.copy_(t["bn_var"][layer, h])
                mlp[3].weight.copy_(t["w2"][layer, h])
                mlp[3].bias.copy_(t["b2"][layer, h])
            mlps.append(mlp)
        _MLPS[key] = mlps
    return _MLPS[key]


def ref_decode(m: SaapModel, layer: int, index: SaapIndex, keys: torch.Tensor,
               values: torch.Tensor, query: torch.Tensor, probes: int, scale: float
               ) -> tuple[torch.Tensor, list[set[int]], torch.Tensor]:
    """One SAAP decode step from scratch over every token so far (keys/values [H, n, D],
    the query's token last): the steady zone (first sinks, the window from the index's
    window start) plus every indexed token whose bucket is among the top ``probes``, exact
    attention. Returns (output [H * G, D], the indexed positions read per head, the bucket
    scores [H, C])."""
    n = keys.shape[1]
    sink, ws = index.num_sinks, index.window_start
    scores = ref_bucket_scores(m, layer, query, n - 1)
    pos = torch.arange(sink, ws)
    buckets = ref_buckets(m, layer, keys[:, sink:ws], pos)
    h_kv = keys.shape[0]
    q = query.reshape(h_kv, -1, query.shape[1]).double()
    out, chosen = [], []
    for h in range(h_kv):
        top = torch.topk(scores[h], probes).indices
        picked = pos[torch.isin(buckets[h], top)]
        chosen.append(set(picked.tolist()))
        read = torch.cat([torch.arange(sink), picked, torch.arange(ws, n)])
        p = torch.softmax(q[h] @ keys[h, read].double().T * scale, dim=-1)
        out.append(p @ values[h, read].double())
    return torch.cat(out).float(), chosen, scores


def check_step(m: SaapModel, layer: int, index: SaapIndex, keys: torch.Tensor,
               values: torch.Tensor, query: torch.Tensor, probes: int,
               atol: float = 1e-5) -> None:
    h_kv = index.num_kv_heads
    scale = query.shape[1] ** -0.5
    res = index.decode(query, scale, return_positions=True)
    want, chosen, scores = ref_decode(m, layer, index, keys, values, query, probes, scale)
    got = [set(p.tolist()) - {-1} - set(range(index.num_sinks))
           - set(range(index.window_start, index.num_tokens))
           for p in res.exact_positions]
    top = torch.topk(scores, probes, dim=1).values
    for h in range(h_kv):
        if got[h] != chosen[h]:  # only a near-tie of bucket scores may differ
            assert top[h, -2] - top[h, -1] < 1e-6 or (
                scores.shape[1] > probes
                and top[h, -1] - scores[h].sort(descending=True).values[probes] < 1e-6)
            return
    torch.testing.assert_close(res.output, want, atol=atol, rtol=1e-5)
    # the chosen buckets are the classifier's top l, in every block
    sel = res.selection.retrieval_ids
    assert sel.shape == (h_kv, probes * index.num_blocks)
    assert res.selection.estimation_ids.numel() == 0



# ---------------------------------------------------------------------- tests

def test_routing_matches_the_reference_on_random_inputs():
    m = model(1)
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(H, 700, D, generator=gen) * 3
    lay = m.layer(2, "cpu")
    pos = torch.arange(100, 800)
    want = ref_buckets(m, 2, keys, pos)
    assert torch.equal(lay.assign(keys, pos, "torch", chunk=256), want)
    # the fused CPU search (product and argmax in one pass) agrees up to near-ties
    assert (lay.assign(keys, pos, "auto") != want).float().mean() < 1e-3
    q = torch.randn(H * G, D, generator=gen)
    torch.testing.assert_close(lay.bucket_scores(q.reshape(H, G, D), 1234).double(),
                               ref_bucket_scores(m, 2, q, 1234), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backed", ["dense", "buffer"])
def test_decode_is_the_papers_selection_and_exact_attention(backed):
    m = model(3)
    gen = torch.Generator().manual_seed(4)
    keys, values = torch.randn(H, 1500, D, generator=gen), torch.randn(H, 1500, D, generator=gen)
    mgr = WaveBufferManager(CFG)
    store = mgr.store("r", H, D, torch.float32, "cpu", layer="L") if backed == "buffer" else None
    index = SaapIndex.build(keys, values, CFG, store=store, model=m,
                            layer="model.layers.1.self_attn.attn")
    assert index.layer == 1 and index.num_clusters == C and index.num_blocks == 1
    assert int(index.sizes.sum()) == H * (1500 - 4 - 32)
    # 300 steps: two update blocks (128 tokens) join as 2 x C more clusters
    decode_steps(index, keys, values, H * G, 300, gen,
        lambda k, v, q: check_step(m, 1, index, k, v, q, CFG.saap.probes), every=3)
    assert index.num_updates == 2 and index.num_blocks == 3 and index.num_clusters == 3 * C
    if backed == "buffer":
        index.store.check_invariants()
    index.free()
    mgr.close()
    assert mgr.host_bytes() == 0


def test_decode_matches_the_reference_on_real_qwen_data(qwen_capture):
    # real post-RoPE keys, values and queries of Qwen2.5 layers; the routing is random (only
    # its arithmetic is under test here): theta and shapes are Qwen's
    cap = qwen_capture
    idn = ModelIdentity("qwen2", 24, 14, 2, 64, 1e6, "f")
    m = random_saap_model(idn, 64, 96, torch.Generator().manual_seed(5))
    for layer in (2, 15):
        lay = cap["layers"][layer]
        q, k, v, positions = lay["q"], lay["k"], lay["v"], lay["positions"]
        p0 = int(positions[0])
        # keys de-RoPEd by the index and by the reference bucket alike
        pos = torch.arange(4, p0)
        assert torch.equal(m.layer(layer, "cpu").assign(k[:, 4:p0], pos),
                           ref_buckets(m, layer, k[:, 4:p0], pos))
        cfg = CFG.replace(saap_probes=6, local_window=64, update_segment=256)
        index = SaapIndex.build(k[:, :p0 + 1], v[:, :p0 + 1], cfg, model=m, layer=layer)
        for j in range(40):
            if j:  # as the engine: the token's K/V first, then its query
                index.append(k[:, p0 + j:p0 + j + 1], v[:, p0 + j:p0 + j + 1])
            assert index.num_tokens - 1 == int(positions[j])
            # fp32 against float64 on Qwen's magnitudes (outputs up to ~4): 5e-5 absolute
            check_step(m, layer, index, k[:, :p0 + j + 1], v[:, :p0 + j + 1], q[:, j],
                       cfg.saap.probes, atol=5e-5)


def test_every_bucket_is_full_attention():
    cfg = CFG.replace(saap_probes=C)
    m = model(6)
    gen = torch.Generator().manual_seed(7)
    keys, values = torch.randn(H, 900, D, generator=gen), torch.randn(H, 900, D, generator=gen)
    mgr = WaveBufferManager(cfg)
    index = SaapIndex.build(keys, values, cfg, model=m, layer=0,
                            store=mgr.store("r", H, D, torch.float32, "cpu", layer="L"))

    def full(k, v, q):
        out = index.decode(q, D ** -0.5).output
        kk, vv = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q, kk) * D ** -0.5, dim=-1)
        torch.testing.assert_close(out, torch.einsum("hn,hnd->hd", p, vv), atol=1e-5,
                                   rtol=1e-5)

    decode_steps(index, keys, values, H * G, 150, gen, full)
    assert index.num_updates == 1
    index.free()
    mgr.close()
    assert mgr.host_bytes() == 0


def test_a_dense_layer_visits_every_bucket():
    m = model(8, dense_layers=(0,))
    keys, values = torch.randn(H, 600, D), torch.randn(H, 600, D)
    dense = SaapIndex.build(keys, values, CFG, model=m, layer=0)
    sparse = SaapIndex.build(keys, values, CFG, model=m, layer=1)
    assert dense.probes == C and sparse.probes == CFG.saap.probes
    q = torch.randn(H * G, D)
    assert dense.select(q, 0.125).retrieval_ids.shape == (H, C)
    assert sparse.select(q, 0.125).retrieval_ids.shape == (H, CFG.saap.probes)


def test_short_context_is_dense_until_indexed():
    index = SaapIndex.build(torch.randn(H, 100, D), torch.randn(H, 100, D), CFG, model=model())
    assert index.is_dense and index.num_clusters == 0
    q = torch.randn(H * G, D)
    assert index.decode(q).selection.retrieval_ids.shape == (H, 0)


def test_build_is_the_nearest_centroid_assignment_only():
    # the layout: cluster b of a block holds exactly the block's keys of bucket b, in order
    m = model(9)
    keys, values = torch.randn(H, 800, D), torch.randn(H, 800, D)
    index = SaapIndex.build(keys, values, CFG, model=m, layer=2)
    want = ref_buckets(m, 2, keys[:, 4:768], torch.arange(4, 768))
    st = index.store
    for h in range(H):
        for b in range(C):
            rows = st.positions[h, st.offsets[h, b]:st.offsets[h, b + 1]]
            assert torch.equal(rows, 4 + (want[h] == b).nonzero()[:, 0])
    assert index.meta_nbytes() == index.meta_rows.pool.nbytes()


def test_file_round_trip_and_identity_checks(tmp_path):
    m = model(10)
    m.training = {"text": "x"}
    path = tmp_path / "m.saap"
    m.save(path)
    got = load_saap(path, IDENTITY)
    assert got is load_saap(path)  # once per process
    for name in m.tensors:
        assert torch.equal(got.tensors[name], m.tensors[name].float())
    assert got.identity == IDENTITY and got.training == {"text": "x"}
    other = ModelIdentity("test", 4, H * G, H, D, 10000.0, "fedcba9876543210", name="other")
    with pytest.raises(SaapFileError, match=r"^saap file .*m\.saap was trained for 3 layers x "
                                            r"2 KV heads x head_dim 64 .*; the model served is "
                                            r"4 layers x 2 KV heads x head_dim 64 .*\[other\]"):
        load_saap(path, other)
    with pytest.raises(SaapFileError, match=r"head_dim 32"):
        got.check_serving(H, 32)


def test_bad_files_and_options_get_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"saap_probes=0 is invalid; accepted: an integer in "
                                          r"\[1, 65536\]"):
        RetroConfig(saap_probes=0)
    with pytest.raises(ConfigError, match=r"saap_file=None is invalid; accepted: the path of a "
                                          r"file written by `vllm-retro calibrate"):
        RetroConfig(index="saap")
    with pytest.raises(ConfigError, match=r"saap_file='/nonexistent/x.saap' is invalid; "
                                          r"accepted: an existing file"):
        RetroConfig(index="saap", saap_file="/nonexistent/x.saap")
    junk = tmp_path / "junk.saap"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(SaapFileError, match=r"^saap file .*junk\.saap cannot be read"):
        load_saap(junk)
    torch.save({"format": "something-else"}, tmp_path / "other.pt")
    with pytest.raises(SaapFileError, match="is not a SAAP file"):
        load_saap(tmp_path / "other.pt")
    payload = model().to_payload()
    payload["version"] = 99
    torch.save(payload, tmp_path / "v99.saap")
    with pytest.raises(SaapFileError, match="has format version 99; this vllm-retro reads "
                                            "version 1"):
        load_saap(tmp_path / "v99.saap")
    payload = model().to_payload()
    payload["tensors"]["w2"] = payload["tensors"]["w2"][:, :, :3]
    torch.save(payload, tmp_path / "cut.saap")
    with pytest.raises(SaapFileError, match=r"tensor 'w2' has shape \(3, 2, 3, 48\)"):
        load_saap(tmp_path / "cut.saap")
    good = tmp_path / "good.saap"
    model().save(good)
    cfg = RetroConfig(index="saap", saap_file=str(good), saap_probes=C + 1)
    with pytest.raises(ConfigError, match=rf"saap_probes={C + 1} is invalid; accepted: an "
                                          rf"integer in \[1, {C}\] \(the buckets of saap file"):
        cfg.check_head_dim(D)
    with pytest.raises(SaapFileError, match=r"this layer has head_dim 32"):
        cfg.replace(saap_probes=4).check_head_dim(32)
    cfg.replace(saap_probes=4).check_head_dim(D)
    with pytest.raises(ConfigError, match=rf"saap_probes={C + 1}"):
        SaapIndex.build(torch.randn(H, 300, D), torch.randn(H, 300, D), cfg)
    with pytest.raises(SaapFileError, match=r"1 KV heads x head_dim 64 \(tensor parallelism"):
        SaapIndex.build(torch.randn(1, 300, D), torch.randn(1, 300, D),
                        cfg.replace(saap_probes=4))


def test_layer_numbers_from_vllm_names():
    assert layer_number("model.layers.17.self_attn.attn") == 17
    assert layer_number(3) == 3
    with pytest.raises(ValueError, match="cannot tell the layer index"):
        layer_number("decoder.attn")
    with pytest.raises(SaapFileError, match="layer 5 is out of range"):
        model().layer(5, "cpu")


def test_selectivity_follows_probes():
    # a balanced partition reads about l / C of the indexed tokens
    m = model(11)
    keys, values = torch.randn(H, 4000, D), torch.randn(H, 4000, D)
    index = SaapIndex.build(keys, values, CFG.replace(saap_probes=4), model=m, layer=1)
    res = index.decode(torch.randn(H * G, D))
    indexed = index.window_start - index.num_sinks
    frac = (res.n_exact.double() - index.num_steady).mean().item() / indexed
    assert 0 < frac < 1 and math.isfinite(frac)


@pytest.mark.parametrize("path", ["fused", "given"])
def test_batched_decode_equals_each_request_decoding_alone(path):
    """A layer's SAAP indexes decoded at once (one classifier pass; then the fused CPU
    kernel with the chosen clusters given, or the exec-buffer path of
    :func:`decode_given` over one layer pool) give each request's own output, across
    update blocks, with rows of different lengths and a dense one; their stores stay
    consistent and every byte is freed."""
    from vllm_retro.kernels import cpu_ext

    if path == "fused" and not cpu_ext.available():
        pytest.skip("the fused CPU kernel is not built")
    cfg = CFG.replace(kernel_backend="auto" if path == "fused" else "torch")
    m = model(7)
    gen = torch.Generator().manual_seed(8)
    mgr = WaveBufferManager(cfg)
    indexes = []
    for r, n in enumerate((1500, 900, 120)):  # the last one dense at first
        k, v = torch.randn(H, n, D, generator=gen), torch.randn(H, n, D, generator=gen)
        st = mgr.store(f"r{r}", H, D, torch.float32, "cpu", layer="L")
        indexes.append(SaapIndex.build(k, v, cfg, store=st, model=m, layer=2))
    batched_equals_alone(indexes, mgr, gen, H * G,
                         check=lambda ix: ix[0].num_updates >= 1 and not ix[2].is_dense)


def test_a_token_budget_visits_the_bucket_count_closest_to_it():
    """``set_token_budget``: per step, the number of top buckets (the same for every KV head)
    whose indexed tokens, averaged over the heads, are closest to the budget; None restores
    ``saap_probes``."""
    m = model(9)
    gen = torch.Generator().manual_seed(10)
    keys, values = torch.randn(H, 2000, D, generator=gen), torch.randn(H, 2000, D, generator=gen)
    index = SaapIndex.build(keys, values, CFG, model=m, layer=1)
    q = torch.randn(H * G, D, generator=gen)
    scores = index.bucket_scores(q)
    ranked = torch.sort(-scores, dim=1, stable=True).indices
    held = index.sizes.long().gather(1, ranked).cumsum(1).float().mean(0)  # [C]
    for budget in (0, 60, 400, 10 ** 6):
        index.set_token_budget(budget)
        res = index.decode(q)
        want = int((held - budget).abs().argmin()) + 1
        assert index.probes == want
        read = (res.n_exact - index.num_steady).float().mean()
        assert float(read) == pytest.approx(float(held[want - 1]))
    index.set_token_budget(None)
    index.decode(q)
    assert index.probes == CFG.saap.probes
