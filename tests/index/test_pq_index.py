"""PQCache as a serving index: its selection and output against a plain-torch reference
written from the paper, its batched path against one request at a time, full budgets,
bad options, and freed memory."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_retro.buffer.manager import WaveBufferManager
from vllm_retro.config import ConfigError, RetroConfig
from vllm_retro.index.padded import MetaViewCache
from vllm_retro.index.pq_index import PQIndex, decode_pq

H, G, D = 2, 4, 64
CFG = RetroConfig(index="pqcache", kernel_backend="torch", sink_tokens=4, local_window=32,
                  update_segment=128, pq_block_tokens=16)


def reference_scores(index: PQIndex, query: torch.Tensor, scale: float) -> torch.Tensor:
    """PQCache's ranking (Zhang et al., §3.2-3.3) from first principles: each indexed key is
    replaced by its codewords' concatenation and scored ``q . k_hat``; the GQA group ranks
    by its summed softmax. Returns [H, N_indexed] float64."""
    books = index.pq.codebooks  # [H, m, K, D / m]
    m = books.shape[1]
    codes = index.codes.long()  # [H, n_idx, m]
    k_hat = torch.cat([books[torch.arange(H)[:, None], s, codes[:, :, s]] for s in range(m)],
                      dim=-1)  # [H, n_idx, D]
    q = query.reshape(H, G, D).double()
    logits = torch.einsum("hgd,hnd->hgn", q, k_hat.double()) * scale
    return torch.softmax(logits, dim=-1).sum(1)  # [H, n_idx]


def reference_attention(index: PQIndex, keys: torch.Tensor, values: torch.Tensor,
                        query: torch.Tensor, chosen: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact attention of query [H * G, D] over the steady zone and the ``chosen`` indexed
    tokens ([H, k] indices); keys/values: every token [H, n, D]. Returns [H * G, D] fp32."""
    sink, n = index.sink_k.shape[1], index.num_tokens
    q = query.reshape(H, G, D).double()
    steady = torch.cat([torch.arange(sink), torch.arange(index.window_start, n)])
    out = []
    for h in range(H):
        pos = torch.cat([steady, sink + chosen[h]])
        kk, vv = keys[h, pos].double(), values[h, pos].double()
        p = torch.softmax(q[h] @ kk.T * scale, dim=-1)
        out.append(p @ vv)
    return torch.cat(out).float()


def _run(index: PQIndex, steps: int, seed: int, keys: torch.Tensor, values: torch.Tensor,
         check=None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        q = torch.randn(H * G, D, generator=gen)
        if check is not None:
            check(index, keys, values, q)
        nk, nv = torch.randn(H, 1, D, generator=gen), torch.randn(H, 1, D, generator=gen)
        index.append(nk, nv)
        keys, values = torch.cat([keys, nk], 1), torch.cat([values, nv], 1)
    return keys, values


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("backed", ["dense", "buffer"])
def test_decode_is_the_papers_selection_and_exact_attention(backed, backend):
    # 'torch': the batched path through the execution buffer and the block cache (CUDA's,
    # on torch kernels); 'auto' on the CPU: the fused kernel reading host pages in place
    cfg = CFG.replace(kernel_backend=backend)
    torch.manual_seed(0)
    keys, values = torch.randn(H, 1500, D), torch.randn(H, 1500, D)
    mgr = WaveBufferManager(cfg)
    store = mgr.store("r", H, D, torch.float32, "cpu", layer="L") if backed == "buffer" else None
    index = PQIndex.build(keys, values, cfg, store=store)
    assert index.num_indexed == 1500 - 4 - 32 and index.pq.codebooks.shape == (H, 2, 64, 32)
    seen = {"steps": 0}

    def check(index, keys, values, q):
        res = index.decode(q, D ** -0.5, return_positions=True)
        score = reference_scores(index, q, D ** -0.5)
        got = res.selection.retrieval_ids
        k = math.ceil(index.config.pq.token_ratio * index.num_indexed - 1e-9)
        assert got.shape == (H, k) and all(row.unique().numel() == k for row in got)
        # the top k by the reference's score (tokens with equal codes tie exactly: any of
        # them may take the last places)
        top = torch.topk(score, k, dim=1).values
        torch.testing.assert_close(score.gather(1, got).sort(1, descending=True).values, top,
                                   atol=1e-9, rtol=1e-6)
        want = reference_attention(index, keys, values, q, got, D ** -0.5)
        torch.testing.assert_close(res.output, want, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(res.lse).all()
        assert torch.equal(res.exact_positions[:, index.num_steady:], got + 4)
        seen["steps"] += 1

    # 300 steps: two update blocks (128 tokens) join the index, encoded with the codebooks
    _run(index, 300, 1, keys, values, check)
    assert seen["steps"] == 300 and index.num_updates >= 2
    if backed == "buffer" and backend == "torch":
        st = index.store
        st.check_invariants()
        s = mgr.stats
        assert s.miss_tokens > 0 and s.hit_tokens == 0  # every token read from the host tier
    index.free()
    mgr.close()
    assert mgr.host_bytes() == 0


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_full_ratio_is_full_attention(backend):
    cfg = CFG.replace(pq_token_ratio=1.0, kernel_backend=backend)
    torch.manual_seed(1)
    keys, values = torch.randn(H, 900, D), torch.randn(H, 900, D)
    mgr = WaveBufferManager(cfg)
    index = PQIndex.build(keys, values, cfg,
                          store=mgr.store("r", H, D, torch.float32, "cpu", layer="L"))

    def check(index, keys, values, q):
        out = index.decode(q, D ** -0.5).output
        kk, vv = keys.repeat_interleave(G, 0), values.repeat_interleave(G, 0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q, kk) * D ** -0.5, dim=-1)
        torch.testing.assert_close(out, torch.einsum("hn,hnd->hd", p, vv), atol=1e-5,
                                   rtol=1e-5)

    _run(index, 150, 2, keys, values, check)
    mgr.close()


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_equals_each_request_alone(dtype, backend):
    # three requests of different lengths in one layer pool, one leaving and one joining
    # mid-way, against twins decoded one by one with pools of their own
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    cfg = CFG.replace(kernel_backend=backend)
    mgr = WaveBufferManager(cfg)
    gen = torch.Generator().manual_seed(3)

    def make(n, layer):
        k = torch.randn(H, n, D, generator=gen).to(dtype)
        v = torch.randn(H, n, D, generator=gen).to(dtype)
        pair = []
        for lay in (layer, None):
            st = mgr.store(f"r{n}{lay}", H, D, dtype, "cpu", layer=lay)
            pair.append(PQIndex.build(k, v, cfg, store=st))
        return pair

    live = [make(n, "L") for n in (400, 1100, 2000)]
    cache = MetaViewCache()
    for step in range(160):
        if step == 60:
            for i in live.pop(0):
                i.free()
        if step == 90:
            live.append(make(700, "L"))
        batch = [p[0] for p in live]
        q = torch.randn(len(batch), H * G, D, generator=gen).to(dtype)
        out = torch.empty_like(q)
        chosen, _ = decode_pq(batch, q, D ** -0.5, out, cache, want_chosen=True)
        for b, (_, twin) in enumerate(live):
            alone = twin.decode(q[b], D ** -0.5)
            if dtype == torch.float32:  # 16-bit scores may order near-ties differently
                assert (np.sort(chosen[b], 1)
                        == np.sort(alone.selection.retrieval_ids.numpy(), 1)).all()
            torch.testing.assert_close(out[b], alone.output, **tol)
        for pair in live:
            nk = torch.randn(H, 1, D, generator=gen).to(dtype)
            nv = torch.randn(H, 1, D, generator=gen).to(dtype)
            for i in pair:
                i.append(nk, nv)
    cache.clear()
    for pair in live:
        pair[0].store.check_invariants()
        for i in pair:
            i.free()
    assert mgr.host_bytes() == 0
    mgr.close()


def test_bad_pq_options_name_the_value_and_range():
    with pytest.raises(ConfigError, match=r"pq_bits=9 .*\[1, 8\]"):
        RetroConfig(pq_bits=9)
    with pytest.raises(ConfigError, match=r"pq_token_ratio=0 .*\(0\.0, 1\.0\]"):
        RetroConfig(pq_token_ratio=0)
    with pytest.raises(ConfigError, match=r"index='hnsw'.*'wave', 'pqcache'"):
        RetroConfig(index="hnsw")
    with pytest.raises(ConfigError, match=r"pq_subspaces=3 .*divisor of the model's head_dim 64"):
        PQIndex.build(torch.randn(H, 300, D), torch.randn(H, 300, D),
                      CFG.replace(pq_subspaces=3))
