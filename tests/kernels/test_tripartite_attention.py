"""kernels.tripartite_attention: weighted decode attention (exact tokens + size-weighted
centroids), Triton vs torch reference, and the reference vs the paper's eq. 2-4 written
out; the tilted estimator (spread-corrected clusters) likewise, and its log-tilt against
quadrature."""

import pytest
import torch
import triton
import triton.language as tl

from vllm_retro.kernels.tripartite_attention import (
    TiltTerms,
    log_tilt_ref,
    log_tilt_tl,
    merge_partials,
    tripartite_decode_ref,
    tripartite_decode_triton,
    truncated_variance_ref,
)


def _inputs(r, g, t, c, e, d, dtype, rng):
    q = torch.randn(r, g, d, generator=rng)
    kx, vx = torch.randn(r, t, d, generator=rng), torch.randn(r, t, d, generator=rng)
    cen, vs = torch.randn(r, c, d, generator=rng), torch.randn(r, c, d, generator=rng) * 4
    sizes = torch.randint(0, 20, (r, c), generator=rng).to(torch.int32)
    vs = vs * (sizes > 0)[..., None]  # an empty cluster has no value sum
    n_exact = torch.randint(0, t + 1, (r,), generator=rng)
    n_exact[0] = t
    est = torch.stack([torch.randperm(c, generator=rng)[:e] for _ in range(r)]) if e else \
        torch.zeros(r, 0, dtype=torch.int64)
    n_est = torch.randint(0, e + 1, (r,), generator=rng)
    if r > 1:
        n_est[1] = e
    cast = lambda x: x.to(dtype)  # noqa: E731
    return (cast(q), cast(kx), cast(vx), n_exact, cast(cen), cast(vs), sizes, est, n_est)


def _check_written_out(args, out, lse, scale, cluster):
    """Compare (out, lse) with the softmax written out per row and head in fp64: exact tokens
    weighted e^{s q.k_j}, then ``cluster(i, h, cid) -> (weight, weighted value)`` per
    estimated cluster."""
    q, kx, vx, nx, _, _, _, est, ne = args
    r, g, d = q.shape
    for i in range(r):
        for h in range(g):
            num = torch.zeros(d, dtype=torch.float64)
            den = torch.tensor(0.0, dtype=torch.float64)
            for j in range(int(nx[i])):
                w = torch.exp(q[i, h] @ kx[i, j] * scale)
                num, den = num + w * vx[i, j], den + w
            for m in range(int(ne[i])):
                w, wv = cluster(i, h, int(est[i, m]))
                num, den = num + wv, den + w
            if den > 0:
                torch.testing.assert_close(out[i, h], num / den, rtol=1e-5, atol=1e-5)
                assert abs(float(lse[i, h]) - float(torch.log(den))) < 1e-5
            else:
                assert (out[i, h] == 0).all() and lse[i, h] == float("-inf")


def test_ref_matches_paper_equations(rng):
    """out = (sum_j e^{s_j} v_j + sum_i e^{q.C_i} VS_i) / (sum_j e^{s_j} + sum_i s_i e^{q.C_i})"""
    r, g, t, c, e, d = 3, 2, 9, 12, 5, 32
    args = _inputs(r, g, t, c, e, d, torch.float64, rng)
    q, _, _, _, cen, vs, sizes, _, _ = args
    scale = d ** -0.5
    out, lse = tripartite_decode_ref(*args, scale)

    def cluster(i, h, cid):
        w = torch.exp(q[i, h] @ cen[i, cid] * scale)
        return sizes[i, cid] * w, w * vs[i, cid]

    _check_written_out(args, out, lse, scale, cluster)


@pytest.mark.parametrize("r,g,t,c,e,d", [
    (1, 1, 1, 1, 1, 32), (4, 7, 90, 50, 20, 64), (3, 8, 200, 64, 30, 128),
    (2, 2, 40, 16, 16, 80), (2, 4, 70, 33, 9, 256), (5, 1, 130, 10, 0, 64),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_triton_matches_ref(r, g, t, c, e, d, dtype, splits, rng, triton_device):
    args = _inputs(r, g, t, c, e, d, dtype, rng)
    scale = d ** -0.5
    ref_o, ref_l = tripartite_decode_ref(*args, scale)
    dev_args = [a.to(triton_device) for a in args]
    got_o, got_l = tripartite_decode_triton(*dev_args, scale, num_splits=splits)
    got_o, got_l = got_o.cpu(), got_l.cpu()
    assert not got_o.isnan().any() and not got_l.isnan().any()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got_o.float(), ref_o.float(), rtol=tol, atol=tol)
    fin = torch.isfinite(ref_l)
    assert (torch.isfinite(got_l) == fin).all()
    torch.testing.assert_close(got_l[fin], ref_l[fin], rtol=1e-5, atol=1e-5)


def test_nothing_to_attend_gives_zeros_not_nan(triton_device):
    args = _inputs(2, 3, 5, 4, 2, 32, torch.float32, torch.Generator().manual_seed(0))
    q, kx, vx, _, cen, vs, sizes, est, _ = args
    zero = torch.zeros(2, dtype=torch.int64)
    for fn in (tripartite_decode_ref, tripartite_decode_triton):
        dev = triton_device if fn is tripartite_decode_triton else "cpu"
        a = [x.to(dev) for x in (q, kx, vx, zero, cen, vs, sizes, est, zero)]
        out, lse = fn(*a, 0.1)
        assert (out.cpu() == 0).all() and torch.isinf(lse.cpu()).all()


def test_merge_partials_equals_single_pass(rng):
    """Splitting the keys anywhere and merging the partial states gives the same answer."""
    g, n, d = 3, 40, 16
    q, k, v = (torch.randn(1, g, d, generator=rng), torch.randn(1, n, d, generator=rng),
               torch.randn(1, n, d, generator=rng))
    s = torch.bmm(q, k.transpose(1, 2))[0]  # [g, n]
    cuts = [0, 7, 7, 25, n]  # includes an empty split
    accs, ms, ls = [], [], []
    for a, b in zip(cuts[:-1], cuts[1:], strict=False):
        part = s[:, a:b]
        m = part.amax(1) if b > a else torch.full((g,), float("-inf"))
        msafe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(part - msafe[:, None])
        accs.append(p @ v[0, a:b])
        ms.append(m)
        ls.append(p.sum(1))
    out, lse = merge_partials(torch.stack(accs)[None], torch.stack(ms)[None],
                              torch.stack(ls)[None])
    torch.testing.assert_close(out[0], torch.softmax(s, 1) @ v[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0], torch.logsumexp(s, 1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the tilted estimator
def _tilt(r, g, c, d, rng, strength=1.0):
    spreads = torch.rand(r, c, generator=rng) * 3 * strength
    deviates = 0.55 + torch.rand(r, c, generator=rng) * 2.5  # Blom: a(2) = 0.589
    deviates[:, ::5] = 0.0  # size-1 clusters: no correction
    qvar = torch.rand(r, g, generator=rng) * 4 * strength
    vshift = torch.randn(r, g, d, generator=rng) * 0.3
    return TiltTerms(spreads, deviates, qvar, vshift)


def _truncated_mgf(v: float, a: float) -> float:
    """log E[exp(sqrt(v) Y)], Y ~ N(0,1) truncated to [-a, a] and rescaled to unit variance,
    by fine quadrature (fp64)."""
    y = torch.linspace(-a, a, 200_001, dtype=torch.float64)
    dens = torch.exp(-y * y / 2)
    z = torch.trapezoid(dens, y)
    sd = float(torch.trapezoid(dens * y * y, y) / z) ** 0.5
    return float(torch.log(torch.trapezoid(dens * torch.exp(v ** 0.5 * y / sd), y) / z))


@pytest.mark.parametrize("v,a", [(0.01, 1.7), (0.5, 1.7), (3.0, 0.6), (4.0, 1.77), (30.0, 2.0),
                                 (400.0, 1.5), (2500.0, 2.4)])
def test_log_tilt_ref_is_the_truncated_normal_mgf(v, a):
    got = float(log_tilt_ref(torch.tensor(v), torch.tensor(a)))
    assert got == pytest.approx(_truncated_mgf(v, a), rel=1e-5, abs=1e-6)


def test_log_tilt_bounds():
    """0 (the Jensen bound) <= log_tilt <= min(v / 2 (log-normal), the largest deviate
    a * sqrt(v / truncated variance)); ~v / 2 for small v; no correction for size-1 clusters
    or zero variance; finite for huge v."""
    v = torch.logspace(-6, 8, 300)
    for a in (0.3, 1.0, 1.77, 3.0):
        lt = log_tilt_ref(v, torch.full_like(v, a))
        assert torch.isfinite(lt).all()
        assert (lt >= 0).all() and (lt <= v / 2 + 1e-6).all()
        top = a * (v / truncated_variance_ref(torch.tensor(a))).sqrt()
        assert (lt <= top + 1e-5).all()
        assert (lt[1:] >= lt[:-1] - 1e-6).all()  # monotone in v
        small = v < 1e-3
        torch.testing.assert_close(lt[small], v[small] / 2, rtol=2e-3, atol=1e-9)
    assert float(log_tilt_ref(torch.tensor(5.0), torch.tensor(0.0))) == 0.0
    assert float(log_tilt_ref(torch.tensor(0.0), torch.tensor(1.5))) == 0.0


@triton.jit
def _log_tilt_grid(V, A, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(V + offs, mask=mask, other=0.0)
    a = tl.load(A + offs, mask=mask, other=0.0)
    tl.store(OUT + offs, log_tilt_tl(v, a), mask=mask)


def test_triton_log_tilt_matches_ref(triton_device):
    """The kernel's cancellation-free form agrees with the fp64 reference from v = 0 to 1e8."""
    vv, aa = torch.meshgrid(torch.cat([torch.zeros(1), torch.logspace(-7, 8, 400)]),
                            torch.cat([torch.zeros(1), torch.linspace(0.5, 4.0, 40)]),
                            indexing="ij")
    v, a = vv.flatten().contiguous(), aa.flatten().contiguous()
    out = torch.empty_like(v, device=triton_device)
    _log_tilt_grid[(triton.cdiv(v.numel(), 256),)](v.to(triton_device), a.to(triton_device),
                                                  out, v.numel(), BLOCK=256)
    ref = log_tilt_ref(v, a)
    out = out.cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


def test_ref_tilted_matches_written_out_estimator(rng):
    """w_i = size_i e^{s q.C_i} e^{lt_i}, value_i = VS_i / size_i + sp_i vshift."""
    r, g, t, c, e, d = 3, 2, 9, 12, 5, 32
    args = _inputs(r, g, t, c, e, d, torch.float64, rng)
    q, _, _, _, cen, vs, sizes, _, _ = args
    tilt = _tilt(r, g, c, d, rng)
    scale = d ** -0.5
    out, lse = tripartite_decode_ref(*args, scale, tilt)

    def cluster(i, h, cid):
        if sizes[i, cid] == 0:
            return torch.tensor(0.0, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
        sp = tilt.spreads[i, cid].double()
        lt = log_tilt_ref(tilt.qvar[i, h] * tilt.spreads[i, cid], tilt.deviates[i, cid])
        w = sizes[i, cid] * torch.exp(q[i, h] @ cen[i, cid] * scale + lt.double())
        return w, w * (vs[i, cid] / sizes[i, cid] + sp * tilt.vshift[i, h].double())

    _check_written_out(args, out, lse, scale, cluster)


def test_zero_spread_tilt_is_the_paper_estimator(rng):
    args = _inputs(3, 4, 20, 16, 8, 64, torch.float32, rng)
    tilt = _tilt(3, 4, 16, 64, rng)
    flat = TiltTerms(torch.zeros_like(tilt.spreads), tilt.deviates, tilt.qvar, tilt.vshift)
    o1, l1 = tripartite_decode_ref(*args, 0.125)
    o2, l2 = tripartite_decode_ref(*args, 0.125, flat)
    torch.testing.assert_close(o1, o2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("r,g,t,c,e,d", [
    (1, 1, 1, 1, 1, 32), (4, 7, 90, 50, 20, 64), (3, 8, 200, 64, 30, 128),
    (2, 4, 70, 33, 9, 256), (5, 1, 130, 10, 0, 64),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_triton_tilted_matches_ref(r, g, t, c, e, d, dtype, splits, rng, triton_device):
    args = _inputs(r, g, t, c, e, d, dtype, rng)
    tilt = _tilt(r, g, c, d, rng, strength=4.0)
    scale = d ** -0.5
    ref_o, ref_l = tripartite_decode_ref(*args, scale, tilt)
    dev_args = [a.to(triton_device) for a in args]
    dev_tilt = TiltTerms(*(x.to(triton_device) for x in (tilt.spreads, tilt.deviates,
                                                          tilt.qvar, tilt.vshift)))
    got_o, got_l = tripartite_decode_triton(*dev_args, scale, dev_tilt, num_splits=splits)
    got_o, got_l = got_o.cpu(), got_l.cpu()
    assert not got_o.isnan().any() and not got_l.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_o.float(), ref_o.float(), rtol=tol, atol=tol)
    fin = torch.isfinite(ref_l)
    assert (torch.isfinite(got_l) == fin).all()
    torch.testing.assert_close(got_l[fin], ref_l[fin], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the torch fast path
@pytest.mark.parametrize("r,g,t,c,e,d", [
    (1, 1, 1, 1, 1, 32), (4, 7, 90, 50, 20, 64), (3, 8, 200, 64, 30, 128),
    (2, 4, 70, 33, 9, 256), (5, 1, 130, 10, 0, 64), (3, 2, 0, 12, 5, 32),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tilted", [False, True])
def test_torch_fast_path_matches_ref(r, g, t, c, e, d, dtype, tilted, rng):
    """The torch backend's two-block form equals the reference (fp32 1e-5, bf16 1e-2) on
    ragged rows (fewer exact tokens or estimated clusters than the padding), empty clusters,
    no estimation zone and no exact token; -inf and zeros where nothing is attended."""
    from vllm_retro.kernels.tripartite_attention import tripartite_decode_torch

    args = _inputs(r, g, t, c, e, d, dtype, rng)
    tilt = _tilt(r, g, c, d, rng) if tilted else None
    scale = d ** -0.5
    ref_o, ref_l = tripartite_decode_ref(*args, scale, tilt)
    got_o, got_l = tripartite_decode_torch(*args, scale, tilt)
    assert got_o.dtype == ref_o.dtype and not got_o.isnan().any() and not got_l.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_o.float(), ref_o.float(), rtol=tol, atol=tol)
    fin = torch.isfinite(ref_l)
    assert (torch.isfinite(got_l) == fin).all()
    torch.testing.assert_close(got_l[fin], ref_l[fin], rtol=1e-5, atol=1e-5)


def test_torch_fast_path_nothing_to_attend():
    from vllm_retro.kernels.tripartite_attention import tripartite_decode_torch

    args = _inputs(2, 3, 5, 4, 2, 32, torch.float32, torch.Generator().manual_seed(0))
    q, kx, vx, _, cen, vs, sizes, est, _ = args
    zero = torch.zeros(2, dtype=torch.int64)
    out, lse = tripartite_decode_torch(q, kx, vx, zero, cen, vs, sizes, est, zero, 0.1)
    assert (out == 0).all() and torch.isinf(lse).all()


def _dirty(args, est_slots: int, keys_only: bool = False):
    """A copy of ``args`` with NaN in row 1's query (head 2), and in row 2's slots past its
    exact tokens and clusters it does not estimate (an execution buffer's stale rows):
    values and cluster rows too unless ``keys_only``."""
    dirty = [a.clone() for a in args]
    dirty[0][1, 2, 7] = float("nan")
    n = int(args[3][2])
    dirty[1][2, n:] = float("nan")
    if not keys_only:
        dirty[2][2, n:] = float("nan")
        unused = sorted(set(range(args[4].shape[1])) - set(args[7][2, :est_slots].tolist()))
        dirty[4][2, unused] = float("nan")
        dirty[5][2, unused] = float("nan")
    return dirty


@pytest.mark.parametrize("splits", [None, 3])
def test_nan_stays_in_its_row_and_unread_slots_are_never_read(splits, triton_device):
    """A NaN in one row's query reaches only that row (head); NaN in the slots past a row's
    exact tokens and in clusters it does not estimate reaches nothing: every other output
    equals the clean one, in the reference and the Triton kernel. The torch path
    (``tripartite_decode_torch``, a fallback) keeps NaN keys there out, not values: masking
    them would cost it 1.5-2.3x (measured on CPU), and no serving route reads stale rows
    through it on the GPU."""
    from vllm_retro.kernels.tripartite_attention import tripartite_decode_torch

    args = list(_inputs(4, 3, 40, 16, 6, 32, torch.float32, torch.Generator().manual_seed(5)))
    args[3][2], args[8][2] = 25, 3  # row 2: 25 exact tokens of 40, 3 clusters of 6
    scale = 32 ** -0.5
    clean_o, clean_l = tripartite_decode_ref(*args, scale)
    cases = (("reference", tripartite_decode_ref, "cpu", {}, False),
             ("triton", tripartite_decode_triton, triton_device, {"num_splits": splits}, False),
             ("torch", tripartite_decode_torch, "cpu", {}, True))
    for name, fn, dev, kw, keys_only in cases:
        out, lse = fn(*[a.to(dev) for a in _dirty(args, 3, keys_only)], scale, **kw)
        out, lse = out.cpu(), lse.cpu()
        for rows in ([0, 2, 3], ([1, 1], [0, 1])):
            assert not out[rows].isnan().any(), name
            torch.testing.assert_close(out[rows], clean_o[rows], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[rows], clean_l[rows], rtol=1e-5, atol=1e-5)
