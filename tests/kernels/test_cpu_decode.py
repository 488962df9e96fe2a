"""kernels.cpu_decode: the fused batched CPU decode (C++ extension) against its plain-torch
reference, on random rows of mixed shapes, and on real attention data."""

import pytest
import torch

from vllm_retro.kernels import cpu_decode
from vllm_retro.kernels.cpu_decode import DecodeRow, decode_rows, decode_rows_ref


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu_decode.load() is not None, f"extension not built: {cpu_decode.load_error()}"


def _row(h, d, c, n_sink, n_win, dtype, rng, paged, rank=4, empty_frac=0.2):
    """A random row: c clusters per head of 1..24 tokens (some empty), in a pool laid out
    per head (dense store) or in pages of 8 rows (wave buffer's host tier)."""
    sizes = torch.randint(1, 25, (h, c), generator=rng)
    sizes[torch.rand(h, c, generator=rng) < empty_frac] = 0
    if paged:
        page = 8
        pages = (sizes + page - 1) // page
        flat = pages.reshape(-1)
        starts = (torch.cumsum(flat, 0) - flat).reshape(h, c) + 3  # pages 0-2 unused
        rows = int(flat.sum() + 3) * page
        head_rows, mult = 0, page
    else:
        flat = sizes.reshape(h, c)
        starts = torch.cumsum(flat, 1) - flat
        rows = int(flat.sum(1).max()) * h if c else 0
        head_rows = int(flat.sum(1).max()) if c else 0
        mult = 1
    keys = torch.randn(max(rows, 1), d, generator=rng).to(dtype)
    values = torch.randn(max(rows, 1), d, generator=rng).to(dtype)
    cen = torch.randn(h, c, d, generator=rng).to(dtype)
    vs = (torch.randn(h, c, d, generator=rng) * sizes[..., None]).to(dtype)
    spreads = torch.rand(h, c, generator=rng) * 2
    deviates = torch.where(sizes > 1, 0.5 + torch.rand(h, c, generator=rng) * 1.5, 0.0)
    prof = torch.rand(h, d, generator=rng)
    prof = prof / prof.sum(1, keepdim=True)
    kf = torch.randn(h, d, rank, generator=rng) * 0.1
    vf = torch.randn(h, d, rank, generator=rng) * 0.1
    sink = torch.randn(2, h, n_sink, d, generator=rng).to(dtype)
    win_buf = torch.randn(2, h, n_win + 5, d, generator=rng).to(dtype)  # a view, as in the index
    r = max(1, c // 20) if c else 0
    e = min(c - r, c // 4) if c else 0
    return DecodeRow(cen, vs, sizes.to(torch.int32), spreads, deviates, prof, kf, vf, keys,
                     values, starts.long(), head_rows, mult, sink[0], sink[1],
                     win_buf[0, :, :n_win], win_buf[1, :, :n_win], r, e)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tilted", [True, False])
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128), (8, 256), (7, 64)])
def test_matches_reference_on_mixed_rows(dtype, tol, tilted, group, d):
    rng = torch.Generator().manual_seed(group * 1000 + d + tilted)
    h = 2
    shapes = [(300, 4, 70, True), (41, 0, 12, False), (0, 4, 9, True), (160, 4, 1, False),
              (2, 1, 64, True)]
    rows = [_row(h, d, c, s, w, dtype, rng, paged) for c, s, w, paged in shapes]
    q = torch.randn(len(rows), h * group, d, generator=rng).to(dtype)
    scale = d ** -0.5
    width = max(r.n_retrieval + r.n_estimation for r in rows)
    out, lse, sel = decode_rows(q, rows, scale, tilted, selection_width=width)
    ref_out, ref_lse, ref_sel = decode_rows_ref(q, rows, scale, tilted)
    assert not torch.isnan(out).any()
    for b, s in enumerate(ref_sel):
        k = s.shape[1]
        assert torch.equal(sel[b, :, :k], s), f"row {b}: selection differs"
        assert (sel[b, :, k:] == -1).all()
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_out_written_in_place_through_strided_views():
    """The route passes slices of vLLM's query and output buffers: strided on dim 0."""
    rng = torch.Generator().manual_seed(3)
    rows = [_row(2, 64, 50, 4, 20, torch.float32, rng, True) for _ in range(3)]
    qkv = torch.randn(3, 3 * 2 * 4 * 64, generator=rng)
    q = qkv[:, :2 * 4 * 64].view(3, 8, 64)  # stride(0) != 8 * 64
    out_buf = torch.full((5, 8, 64), 7.0)
    decode_rows(q, rows, 0.125, True, out=out_buf[1:4])
    ref, _, _ = decode_rows_ref(q, rows, 0.125, True)
    torch.testing.assert_close(out_buf[1:4], ref, rtol=1e-5, atol=1e-5)
    assert (out_buf[0] == 7).all() and (out_buf[4] == 7).all()


def test_phase_split_changes_nothing_and_covers_the_call():
    """With ``phases`` the kernel also reports its wall time split by phase: every phase is
    present and non-negative, the split adds up to the call, and the output is the same."""
    rng = torch.Generator().manual_seed(5)
    rows = [_row(2, 64, c, 4, 20, torch.float32, rng, True) for c in (400, 0, 90)]
    q = torch.randn(3, 8, 64, generator=rng)
    packed = [cpu_decode.pack_row(r, True) for r in rows]
    plain, _, _ = cpu_decode.decode_packed(q, packed, 0.125, True)
    phases: dict[str, float] = {}
    timed, _, _ = cpu_decode.decode_packed(q, packed, 0.125, True, phases=phases)
    assert torch.equal(plain, timed)
    assert set(phases) == {"kernel " + p for p in cpu_decode.PHASES}
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) > 0


def test_nothing_to_attend_gives_zeros_and_minus_inf():
    rng = torch.Generator().manual_seed(4)
    row = _row(2, 64, 0, 0, 0, torch.float32, rng, False)
    out, lse, _ = decode_rows(torch.randn(1, 4, 64), [row], 0.125, True)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.real_model
def test_real_attention_data(qwen_capture):
    """Rows built by the wave index from a real model's keys and values (Qwen2.5-Coder-0.5B,
    prose) give the reference's outputs, in fp32 and bf16."""
    from vllm_retro.config import RetroConfig
    from vllm_retro.index.batched import decode_row
    from vllm_retro.index.wave_index import WaveIndex

    d = qwen_capture["layers"][15]
    cfg = RetroConfig(kmeans_iters=4)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        rows, queries = [], []
        for n in (1500, 3000, 4000):
            idx = WaveIndex.build(d["k"][:, :n].to(dtype), d["v"][:, :n].to(dtype), cfg)
            rows.append(decode_row(idx))
            queries.append(d["q"][:, -1 - len(queries)])  # real decode-time queries
        q = torch.stack(queries).to(dtype)
        out, lse, _ = decode_rows(q, rows, qwen_capture["scale"], True)
        ref, ref_lse, _ = decode_rows_ref(q, rows, qwen_capture["scale"], True)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- attend_rows

def _attend_case(b, h, group, d, dtype, rng, ks=None):
    """Random rows for attend_rows: a pool of 300 rows per request, k_b tokens per head
    (0 included), sinks and a window view of a longer buffer."""
    ks = ks or [int(torch.randint(0, 60, (1,), generator=rng)) for _ in range(b)]
    pools = [(torch.randn(300, d, generator=rng).to(dtype),
              torch.randn(300, d, generator=rng).to(dtype)) for _ in range(b)]
    rows = [torch.randint(0, 300, (h, k), generator=rng) for k in ks]
    steady, n_win = [], []
    for _ in range(b):
        buf = torch.randn(2, h, 40, d, generator=rng).to(dtype)
        sink = torch.randn(2, h, 4, d, generator=rng).to(dtype)
        steady.append((sink[0], sink[1], buf[0], buf[1]))
        n_win.append(int(torch.randint(0, 41, (1,), generator=rng)))
    q = torch.randn(b, h * group, d, generator=rng).to(dtype)
    return q, pools, rows, steady, n_win


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128), (8, 256), (7, 64)])
def test_attend_rows_matches_reference(dtype, tol, group, d):
    rng = torch.Generator().manual_seed(group * d)
    args = _attend_case(4, 2, group, d, dtype, rng, ks=[0, 1, 33, 59])
    out, lse = cpu_decode.attend_rows(*args, scale=d ** -0.5)
    ref, ref_lse = cpu_decode.attend_rows_ref(*args, scale=d ** -0.5)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_attend_rows_with_nothing_gives_zeros_and_minus_inf():
    rng = torch.Generator().manual_seed(9)
    q, pools, rows, steady, _ = _attend_case(1, 2, 4, 64, torch.float32, rng, ks=[0])
    steady = [(s[:, :0], v[:, :0], w, x) for s, v, w, x in steady]
    out, lse = cpu_decode.attend_rows(q, pools, rows, steady, [0], 0.125)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.real_model
def test_attend_rows_on_real_attention_data(qwen_capture):
    """PQCache's picks over a real model's keys and values (Qwen2.5-Coder-0.5B, prose),
    read from a wave buffer's host pool, give the reference's outputs in fp32 and bf16."""
    from vllm_retro.buffer.manager import WaveBufferManager
    from vllm_retro.config import RetroConfig
    from vllm_retro.index.pq_index import PQIndex

    d = qwen_capture["layers"][15]
    cfg = RetroConfig(index="pqcache", kmeans_iters=4)
    scale = qwen_capture["scale"]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        mgr = WaveBufferManager(cfg)
        q, pools, rows, steady, n_win = [], [], [], [], []
        for b, n in enumerate((1500, 3000, 4000)):
            k, v = d["k"][:, :n].to(dtype), d["v"][:, :n].to(dtype)
            st = mgr.store(f"r{b}", k.shape[0], k.shape[2], dtype, "cpu", layer="L")
            idx = PQIndex.build(k, v, cfg, store=st)
            qb = d["q"][:, -1 - b].to(dtype)
            picked = idx.select(qb, scale).retrieval_ids.numpy()
            pk, pv, starts, head_rows, mult = st.cluster_rows()
            h = k.shape[0]
            heads = torch.arange(h)[:, None]
            c = torch.from_numpy(idx.token_cluster[picked])
            rows.append(head_rows * heads + starts[heads, c] * mult
                        + torch.from_numpy(idx.token_offset[picked]))
            pools.append((pk, pv))
            steady.append((idx.sink_k, idx.sink_v, idx.win_k, idx.win_v))
            n_win.append(idx.win_k.shape[1])
            q.append(qb)
        qs = torch.stack(q)
        out, lse = cpu_decode.attend_rows(qs, pools, rows, steady, n_win, scale)
        ref, ref_lse = cpu_decode.attend_rows_ref(qs, pools, rows, steady, n_win, scale)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        mgr.close()
