"""kernels.cpu_decode: the fused batched CPU decode (C++ extension) against its plain-torch
reference, on random rows of mixed shapes, and on real attention data."""

import dataclasses

import pytest
import torch

from vllm_retro.kernels import cpu_decode, cpu_ext
from vllm_retro.kernels.cpu_decode import DecodeRow, decode_rows, decode_rows_ref


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu_ext.load() is not None, f"extension not built: {cpu_ext.load_error()}"


@pytest.fixture(params=cpu_ext.SCORING_ISAS)
def scoring_isa(request):
    """Each bf16 scoring path this CPU offers, in turn (the best is restored after)."""
    try:
        if cpu_ext.set_scoring_isa(request.param) != request.param:
            pytest.skip(f"this CPU has no {request.param} scoring path")
        yield request.param
    finally:
        cpu_ext.set_scoring_isa(cpu_ext.SCORING_ISAS[0])


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
    # token-major like the steady pool: [H, n, D] views with a head stride of D
    sink = torch.randn(2, n_sink, h, d, generator=rng).to(dtype).transpose(1, 2)
    ring = torch.randn(2, n_win, h, d, generator=rng).to(dtype).transpose(1, 2)
    first = int(torch.randint(0, max(n_win, 1), (1,), generator=rng))  # the ring wraps
    r = max(1, c // 20) if c else 0
    e = min(c - r, c // 4) if c else 0
    return DecodeRow(cen, vs, sizes.to(torch.int32), spreads, deviates, prof, kf, vf, keys,
                     values, starts.long(), head_rows, mult, sink[0], sink[1], ring[0],
                     ring[1], r, e, win_first=first)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tilted", [True, False])
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128), (8, 256), (7, 64), (3, 40)])
def test_matches_reference_on_mixed_rows(dtype, tol, tilted, group, d, scoring_isa):
    if dtype == torch.float32 and scoring_isa != cpu_ext.SCORING_ISAS[0]:
        pytest.skip("fp32 rows have one scoring path")
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_query_row_leaves_the_other_rows_exact(dtype):
    """A row whose query holds NaNs (a model that overflowed) scores NaN everywhere; its
    selection and its ranking must still name clusters of its own (no read outside its
    pools, no write past the kernel's scratch, no sort on a NaN-broken order), and every
    other row of the batch decodes and ranks as the reference does."""
    rng = torch.Generator().manual_seed(11)
    h, group, d = 2, 4, 64
    rows = [_row(h, d, c, 4, 16, dtype, rng, paged) for c, paged in
            [(400, True), (60, False), (400, False), (9, True)]]
    q = torch.randn(len(rows), h * group, d, generator=rng).to(dtype)
    q[0, :group] = float("nan")  # row 0, KV head 0: every score NaN
    q[2, group:, 5] = float("nan")  # row 2, KV head 1
    width = max(r.n_retrieval + r.n_estimation for r in rows)
    out, lse, sel = decode_rows(q, rows, d ** -0.5, True, selection_width=width)
    ref_out, ref_lse, ref_sel = decode_rows_ref(q, rows, d ** -0.5, True)
    for b, r in enumerate(rows):  # the ranking too (NaN scores ranked without a fault)
        c = r.centroids.shape[1]
        assert ((sel[b] >= 0) & (sel[b] < c) | (sel[b] == -1)).all()
        if b in (1, 3):
            assert torch.equal(sel[b, :, :ref_sel[b].shape[1]], ref_sel[b])
    for b in (1, 3):
        torch.testing.assert_close(out[b].float(), ref_out[b].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse[b], ref_lse[b], rtol=1e-5, atol=1e-5)
    for b in (0, 2):  # the heads without a NaN are untouched by the one that has them
        good = slice(group, None) if b == 0 else slice(0, group)
        torch.testing.assert_close(out[b, good].float(), ref_out[b, good].float(),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_tied_and_empty_clusters_select_like_the_reference(dtype, tol):
    """Scores that tie exactly (a zero query scores every cluster alike) are taken in id
    order up to the budget, and budgets larger than the non-empty clusters reach the empty
    ones' -inf scores, again in id order; the reference ranks with the same tie-break
    (:func:`~vllm_retro.kernels.scoring.top_clusters`), so every row's selection and output
    equal the reference's, tied rows included."""
    rng = torch.Generator().manual_seed(7)
    h, d, group = 2, 64, 4
    rows = []
    for c, empty in [(400, 0.2), (257, 0.0), (120, 0.9), (64, 0.95), (33, 0.5)]:
        row = _row(h, d, c, 2, 8, dtype, rng, True, empty_frac=empty)
        rows.append(dataclasses.replace(row, n_retrieval=c // 7, n_estimation=c // 3))
    q = torch.randn(len(rows), h * group, d, generator=rng).to(dtype)
    q[0::2] = 0  # rows 0, 2, 4: every score ties
    width = max(r.n_retrieval + r.n_estimation for r in rows)
    out, lse, sel = decode_rows(q, rows, d ** -0.5, True, selection_width=width)
    ref_out, ref_lse, ref_sel = decode_rows_ref(q, rows, d ** -0.5, True)
    assert not torch.isnan(out).any()
    for b, row in enumerate(rows):
        k = row.n_retrieval + row.n_estimation
        for hh in range(h):
            filled = row.sizes[hh] > 0
            empty = (~filled).nonzero().flatten()
            # a zero query's ties in id order, then the empty clusters' -inf in id order
            n_filled = int(filled.sum())
            ranked = filled.nonzero().flatten() if b % 2 == 0 else ref_sel[b][hh][:n_filled]
            want = torch.cat([ranked, empty])[:k]
            assert torch.equal(sel[b, hh, :k], want), f"row {b}, head {hh}"
            assert torch.equal(ref_sel[b][hh][:k], want), f"reference: row {b}, head {hh}"
        torch.testing.assert_close(out[b].float(), ref_out[b].float(), rtol=tol, atol=tol)
        torch.testing.assert_close(lse[b], ref_lse[b], rtol=1e-5, atol=1e-5)


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


def test_window_part_of_a_ring_read_from_its_first_row_wrapping():
    """``decode_packed(windows=...)``: each row attends n rows of its ring from a given first
    row on, wrapping at the ring's end, as the reference does with that window."""
    import dataclasses

    rng = torch.Generator().manual_seed(6)
    rows = [_row(2, 64, c, 4, 30, torch.float32, rng, True) for c in (120, 0, 60)]
    windows = [(25, 11), (0, 30), (7, 0)]  # wraps; the whole ring; none
    q = torch.randn(3, 8, 64, generator=rng)
    out, lse, _ = cpu_decode.decode_packed(q, [cpu_decode.pack_row(r, True) for r in rows],
                                           0.125, True, windows=windows)
    cut = [dataclasses.replace(r, win_k=cpu_decode.ring_rows(r.win_k, f, n),
                               win_v=cpu_decode.ring_rows(r.win_v, f, n), win_first=0)
           for r, (f, n) in zip(rows, windows, strict=True)]
    ref, ref_lse, _ = decode_rows_ref(q, cut, 0.125, True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="steady zone out of range"):
        cpu_decode.decode_packed(q, [cpu_decode.pack_row(r, True) for r in rows], 0.125,
                                 True, windows=[(30, 1), (0, 0), (0, 0)])


def test_a_kept_batch_decodes_as_its_rows_with_each_calls_windows():
    """A :class:`PackedBatch` kept across calls (as a layer keeps its batch) is reused only
    for the very same packed rows in the same order, and decodes exactly what its rows
    decode: with each call's windows, and with the rows' own windows when a call gives
    none after one that did."""
    rng = torch.Generator().manual_seed(16)
    rows = [_row(2, 64, c, 4, 30, torch.float32, rng, True) for c in (120, 0, 60)]
    packed = [cpu_decode.pack_row(r, True) for r in rows]
    batch = cpu_decode.pack_batch(packed)
    assert cpu_decode.pack_batch(packed, batch) is batch
    assert cpu_decode.pack_batch(packed[::-1], batch) is not batch
    assert cpu_decode.pack_batch(packed[:2], batch) is not batch
    q = torch.randn(3, 8, 64, generator=rng)
    for windows in ([(25, 11), (0, 30), (7, 0)], [(3, 20), (29, 2), (0, 30)]):
        out, lse, _ = cpu_decode.decode_packed(q, batch, 0.125, True, windows=windows)
        ref, ref_lse, _ = cpu_decode.decode_packed(q, packed, 0.125, True, windows=windows)
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    out, _, _ = cpu_decode.decode_packed(q, batch, 0.125, True)
    assert torch.equal(out, cpu_decode.decode_packed(q, packed, 0.125, True)[0])
    with pytest.raises(ValueError, match="2 windows for a query batch of 3"):
        cpu_decode.decode_packed(q, batch, 0.125, True, windows=[(0, 1), (0, 1)])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_given_selections_attend_those_clusters_exactly(dtype, tol):
    """``decode_packed(given=...)``: each head reads its steady zone and exactly the clusters
    it is given (any order, some empty, none at all), with no scoring and no estimation,
    as the reference does; meta indexes without centroids (a trained router's rows) work."""
    import dataclasses

    rng = torch.Generator().manual_seed(8)
    rows = [_row(2, 64, c, 4, 20, dtype, rng, paged) for c, paged in
            ((200, True), (90, False), (40, True))]
    no_centroids = rows[2].centroids[:, :0]
    rows[2] = dataclasses.replace(rows[2], centroids=no_centroids,
                                  value_sums=no_centroids)
    given = [torch.stack([torch.randperm(c, generator=rng)[:n] for _ in range(2)])
             for c, n in ((200, 17), (90, 0), (40, 40))]
    q = torch.randn(3, 8, 64, generator=rng).to(dtype)
    packed = [cpu_decode.pack_row(r, False) for r in rows]
    out, lse, sel = cpu_decode.decode_packed(q, packed, 0.125, False, selection_width=40,
                                             given=given)
    ref, ref_lse, _ = decode_rows_ref(q, rows, 0.125, False, given=given)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    for b, g in enumerate(given):
        assert torch.equal(sel[b, :, :g.shape[1]], g) and (sel[b, :, g.shape[1]:] == -1).all()
    with pytest.raises(RuntimeError, match="given cluster id is out of range"):
        cpu_decode.decode_packed(q, packed, 0.125, False,
                                 given=[given[0], given[1], given[2] + 1])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128), (7, 64)])
def test_page_bounds_are_scored_by_quests_bound(dtype, tol, group, d, scoring_isa):
    """Rows whose scoring rows are page bounds [H, C, 2D] (each page's key max, then min):
    the kernel ranks pages by the GQA group's summed softmax of Quest's bound
    ``scale * sum_d max(q_d max_d, q_d min_d)`` (checked in float64, written element-wise
    from the paper), reads the top r exactly and estimates nothing, as the reference does."""
    import dataclasses

    if dtype == torch.float32 and scoring_isa != cpu_ext.SCORING_ISAS[0]:
        pytest.skip("fp32 rows have one scoring path")
    rng = torch.Generator().manual_seed(group * 10 + d)
    h = 2
    rows = []
    for c, r, paged in ((300, 12, True), (41, 41, False), (0, 3, True), (90, 5, False)):
        row = _row(h, d, c, 4, 20, dtype, rng, paged)
        a, b = torch.randn(2, h, c, d, generator=rng)
        bounds = torch.cat([torch.maximum(a, b), torch.minimum(a, b)], dim=2).to(dtype)
        rows.append(dataclasses.replace(row, centroids=bounds, n_retrieval=min(r, c),
                                        n_estimation=0))
    q = torch.randn(len(rows), h * group, d, generator=rng).to(dtype)
    scale = d ** -0.5
    out, lse, sel = decode_rows(q, rows, scale, False, selection_width=41)
    ref, ref_lse, ref_sel = decode_rows_ref(q, rows, scale, False)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    for b, row in enumerate(rows):
        k = row.n_retrieval
        qd = q[b].double().reshape(h, group, 1, d)
        hi, lo = row.centroids.double()[:, None].split(d, dim=3)  # [H, 1, C, D]
        bound = torch.maximum(qd * hi, qd * lo).sum(3) * scale  # [H, G, C]
        empty = row.sizes == 0
        bound = bound.masked_fill(empty[:, None], float("-inf"))  # never read
        score = torch.softmax(bound, dim=2).sum(1).masked_fill(empty, -1.0)
        want = torch.topk(score, k, dim=1).indices if k else score[:, :0].long()
        assert torch.equal(sel[b, :, :k].sort(1).values, want.sort(1).values)
        assert torch.equal(ref_sel[b].sort(1).values, want.sort(1).values)
    bad = [dataclasses.replace(rows[0], n_estimation=1)]
    with pytest.raises(RuntimeError, match="page bounds .* need e = 0, got 1"):
        decode_rows(q[:1], bad, scale, False)


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


# ---------------------------------------------------------------------- pq_decode

def _pq_row(h, d, m, n, k, dtype, rng, paged, n_sink=4, n_win=20):
    """A random PQCache row: n indexed tokens in blocks of 1..40 (clusters in token order),
    laid out per head (dense store) or in pages of 8 rows (host tier)."""
    kwords = 16
    codes = torch.randint(0, kwords, (h, n, m), generator=rng).to(torch.uint8)
    books = torch.randn(h, m, kwords, d // m, generator=rng)
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(int(torch.randint(1, 41, (1,), generator=rng)), n - sum(sizes)))
    sizes_t = torch.tensor(sizes, dtype=torch.int64)
    cluster = torch.repeat_interleave(torch.arange(len(sizes)), sizes_t)
    offset = torch.arange(n) - (torch.cumsum(sizes_t, 0) - sizes_t)[cluster]
    if paged:
        page = 8
        pages = (sizes_t + page - 1) // page
        per_head = torch.stack([torch.randperm(len(sizes), generator=rng) for _ in range(h)])
        # each head's clusters in its own order of extents: starts differ across heads
        starts = torch.zeros(h, len(sizes), dtype=torch.int64)
        for hh in range(h):
            first = 2 + hh * int(pages.sum())
            for c in per_head[hh].tolist():
                starts[hh, c] = first
                first += int(pages[c])
        rows = (2 + h * int(pages.sum())) * page
        head_rows, mult = 0, page
    else:
        starts = (torch.cumsum(sizes_t, 0) - sizes_t)[None].expand(h, -1).contiguous()
        rows, head_rows, mult = h * n, n, 1
    win = torch.randn(2, n_win + 6, h, d, generator=rng).to(dtype).transpose(1, 2)
    sink = torch.randn(2, n_sink, h, d, generator=rng).to(dtype).transpose(1, 2)
    pool = torch.randn(2, rows, d, generator=rng).to(dtype)
    # the window: n_win rows of a ring of n_win + 6 from row n_win + 3 on (wrapping)
    return cpu_decode.PQRow(codes, books, cluster, offset, starts, head_rows, mult, pool[0],
                            pool[1], sink[0], sink[1], win[0], win[1], n_win, k,
                            win_first=n_win + 3)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("group,d,m", [(1, 64, 2), (4, 128, 2), (8, 256, 4), (7, 64, 1)])
def test_pq_decode_matches_reference(dtype, tol, group, d, m):
    rng = torch.Generator().manual_seed(group * d + m)
    rows = [_pq_row(2, d, m, n, k, dtype, rng, paged)
            for n, k, paged in ((300, 0, False), (500, 1, True), (800, 160, True),
                                (120, 120, False))]
    q = torch.randn(len(rows), 2 * group, d, generator=rng).to(dtype)
    out, lse, sel = cpu_decode.pq_decode(q, rows, d ** -0.5, selection_width=160)
    ref, ref_lse, chosen = cpu_decode.pq_decode_ref(q, rows, d ** -0.5)
    assert not torch.isnan(out).any()
    for b, c in enumerate(chosen):  # the same tokens (ties by index: codes repeat)
        assert torch.equal(sel[b, :, :c.shape[1]], c) and (sel[b, :, c.shape[1]:] == -1).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_pq_decode_with_nothing_to_attend_gives_zeros_and_minus_inf():
    rng = torch.Generator().manual_seed(9)
    r = _pq_row(2, 64, 2, 50, 0, torch.float32, rng, False, n_sink=0, n_win=0)
    out, lse, _ = cpu_decode.pq_decode(torch.randn(1, 4, 64), [r], 0.125)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.real_model
def test_pq_decode_on_real_attention_data(qwen_capture):
    """PQCache rows built from a real model's keys and values (Qwen2.5-Coder-0.5B, prose),
    read from a wave buffer's host pool, give the reference's outputs and choices in fp32
    and bf16."""
    from vllm_retro.buffer.manager import WaveBufferManager
    from vllm_retro.config import RetroConfig
    from vllm_retro.index.pq_index import PQIndex, pq_row

    d = qwen_capture["layers"][15]
    cfg = RetroConfig(index="pqcache", kmeans_iters=4)
    scale = qwen_capture["scale"]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        mgr = WaveBufferManager(cfg)
        rows, q = [], []
        for b, n in enumerate((1500, 3000, 4000)):
            k, v = d["k"][:, :n].to(dtype), d["v"][:, :n].to(dtype)
            st = mgr.store(f"r{b}", k.shape[0], k.shape[2], dtype, "cpu", layer="L")
            rows.append(pq_row(PQIndex.build(k, v, cfg, store=st)))
            q.append(d["q"][:, -1 - b].to(dtype))
        qs = torch.stack(q)
        out, lse, _ = cpu_decode.pq_decode(qs, rows, scale)
        ref, ref_lse, _ = cpu_decode.pq_decode_ref(qs, rows, scale)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        mgr.close()


def test_tilted_correction_matches_the_reference_on_a_grid():
    """The kernel's fp32 tilted correction (its own tilt_const and log_tilt) against the fp64
    reference, variances 0..1e4. Deviates from 0.5 up (a cluster of >= 2 keys gets >= 0.59):
    within 3e-4 + 2e-5 relative (where the former log_ndtr form lost up to 8e-3). Deviates
    1e-4..0.5 (the Taylor-series range below 0.25 included): finite and within 5e-3. Deviates
    <= 0: no correction."""
    from vllm_retro.kernels.tripartite_attention import log_tilt_ref

    a = torch.cat([torch.logspace(-4, 0.9, 300), torch.tensor([0.0, -1.0, 0.25, 0.2499])])
    v = torch.cat([torch.logspace(-8, 4, 400), torch.tensor([0.0])])
    vv, aa = torch.meshgrid(v, a, indexing="ij")
    got = cpu_ext.load().log_tilt_grid(vv.contiguous(), aa.contiguous())
    ref = log_tilt_ref(vv, aa)
    assert got.isfinite().all() and (got >= 0).all()
    big, small = aa >= 0.5, (aa > 0) & (aa < 0.5)
    torch.testing.assert_close(got[big], ref[big], rtol=2e-5, atol=3e-4)
    torch.testing.assert_close(got[small], ref[small], rtol=2e-5, atol=5e-3)
    assert (got[aa <= 0] == 0).all()


def test_bf16_scoring_uses_the_best_path_the_cpu_has():
    """The bf16 scoring path is chosen at run time: AVX512-BF16 on a CPU listing it, else
    AVX2; the bf16 cases above run each path this CPU has (the ``scoring_isa`` fixture)."""
    import pathlib

    info = pathlib.Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo")
    flags = next((ln.split(":", 1)[1].split() for ln in info.read_text().splitlines()
                  if ln.startswith("flags")), [])
    isa = cpu_ext.scoring_isa()
    if "avx512_bf16" in flags and "avx512bw" in flags:
        assert isa == "avx512bf16"
    else:
        assert isa in ("avx2", "scalar")
    with pytest.raises(ValueError, match="'sse' is not one of avx512bf16, avx2"):
        cpu_ext.set_scoring_isa("sse")


def _layer_pools(rows, tilted, shared, rng, scoring_width=None):
    """``rows`` laid out as a layer holds them (:class:`LayerPools`) and the step plan naming
    them: meta rows in one pool [H, capacity, ...] at shuffled extents with NaN around them,
    the tokens in one shared pool (absolute starts) or a region per pool row (relative
    starts), the steady zones in one steady pool, the residual model per pool row. Rows
    sit in scattered slots; every pool row and meta row no plan column names is NaN."""
    from vllm_retro.kernels.resident_attention import LayerPools
    from vllm_retro.kernels.step_plan import PLAN_FIELDS

    b = len(rows)
    h, _, d = rows[0].sink_k.shape
    dtype = rows[0].kv_keys.dtype
    width = scoring_width or d
    nan = float("nan")
    cap = max(r.centroids.shape[1] for r in rows) + 5
    extents = torch.randperm(b, generator=rng).tolist()  # row i's extent is the extents[i]th
    lengths = [r.centroids.shape[1] for r in rows]
    meta_row, at = [0] * b, 3
    for i in sorted(range(b), key=lambda i: extents[i]):
        meta_row[i], at = at, at + lengths[i] + 2
    capacity = at + 1

    def meta(field, trail, fill, kind):
        t = torch.full((h, capacity, *trail), fill, dtype=kind)
        for i, r in enumerate(rows):
            t[:, meta_row[i]:meta_row[i] + lengths[i]] = getattr(r, field)
        return t

    score = meta("centroids", (width,), nan, dtype)
    vsum = meta("value_sums", (d,), nan, dtype)
    sizes = meta("sizes", (), 7, torch.int32)  # nonzero around the extents: never read
    spreads = meta("spreads", (), nan, torch.float32)
    deviates = meta("deviates", (), nan, torch.float32)
    slots = torch.randperm(b + 3, generator=rng)[:b].tolist()
    steady_slots = torch.randperm(b + 2, generator=rng)[:b].tolist()
    p = (b + 3) * h
    starts = torch.full((p, cap), -(10 ** 9), dtype=torch.int64)
    profile = torch.full((p, d), nan)
    rank = rows[0].key_factor.shape[2] if tilted else 1
    kf = torch.full((p, d, rank), nan)
    vf = torch.full((p, d, rank), nan)
    heads = torch.arange(h)[:, None]
    if shared:
        offsets = torch.tensor([0] + [r.kv_keys.shape[0] for r in rows]).cumsum(0).tolist()
        keys = torch.cat([r.kv_keys for r in rows])
        values = torch.cat([r.kv_values for r in rows])
    else:
        n = max(int((r.sizes.sum(1)).max()) if r.sizes.numel() else 0 for r in rows) + 4
        keys = torch.full((p, n, d), nan, dtype=dtype)
        values = torch.full((p, n, d), nan, dtype=dtype)
    for i, r in enumerate(rows):
        c = lengths[i]
        pr = slice(slots[i] * h, (slots[i] + 1) * h)
        first = r.head_rows * heads + r.cluster_starts[:, :c] * r.start_mult  # [H, C]
        if shared:
            starts[pr, :c] = first + offsets[i]
        else:  # each head's clusters packed at the front of its region
            for hh in range(h):
                at = 0
                for cl in range(c):
                    sz = int(r.sizes[hh, cl])
                    src = int(first[hh, cl])
                    keys[pr.start + hh, at:at + sz] = r.kv_keys[src:src + sz]
                    values[pr.start + hh, at:at + sz] = r.kv_values[src:src + sz]
                    starts[pr.start + hh, cl] = at
                    at += sz
        if tilted:
            profile[pr], kf[pr], vf[pr] = r.profile, r.key_factor, r.value_factor
    sink_cap = max(r.sink_k.shape[1] for r in rows) + 1
    ring = max(r.win_k.shape[1] for r in rows)
    steady_k = torch.full((b + 2, sink_cap + ring, h, d), nan, dtype=dtype)
    steady_v = torch.full_like(steady_k, nan)
    cols = []
    for i, r in enumerate(rows):
        s, ns, w = steady_slots[i], r.sink_k.shape[1], r.win_k.shape[1]
        steady_k[s, :ns] = r.sink_k.transpose(0, 1)
        steady_v[s, :ns] = r.sink_v.transpose(0, 1)
        # the row's ring is rows 0..w-1 of the pool's ring (w <= ring): the window from its
        # first ring row, wrapping at w, is rebased so it wraps at the pool's ring
        n_win = cpu_decode.window_len(r)
        order = (r.win_first + torch.arange(n_win)) % max(w, 1)
        steady_k[s, sink_cap:sink_cap + n_win] = r.win_k[:, order].transpose(0, 1)
        steady_v[s, sink_cap:sink_cap + n_win] = r.win_v[:, order].transpose(0, 1)
        cols.append((slots[i], s, lengths[i], r.n_retrieval, r.n_estimation, ns, 0, n_win, 1,
                     meta_row[i], capacity))
    plan = torch.tensor(cols, dtype=torch.int64).T.contiguous()
    assert plan.shape[0] == len(PLAN_FIELDS)
    pools = LayerPools(keys, values, score.view(-1, width), vsum.view(-1, d), sizes.view(-1),
                       starts, spreads.view(-1), deviates.view(-1), profile, kf, vf, steady_k,
                       steady_v, sink_cap)
    return pools, plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tilted", [True, False])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128), (7, 64)])
def test_decode_plan_reads_the_layers_pools_as_decode_rows_reads_the_rows(
        dtype, tilted, shared, group, d):
    """``decode_plan`` (the CPU's device step: rows addressed by a step plan in the layer's
    pools) gives exactly ``decode_rows``' result on the same rows, whatever the layout: meta
    extents shuffled in one pool, slots scattered, the tokens in one shared pool or a region
    per pool row, windows wrapping; NaN everywhere the plan does not point."""
    rng = torch.Generator().manual_seed(group * 100 + d + 10 * tilted + shared)
    h = 2
    shapes = [(300, 4, 70, True), (41, 0, 12, False), (0, 4, 9, True), (160, 4, 1, False),
              (2, 1, 64, True)]
    rows = [_row(h, d, c, s, w, dtype, rng, paged) for c, s, w, paged in shapes]
    q = torch.randn(len(rows), h * group, d, generator=rng).to(dtype)
    scale = d ** -0.5
    want, _, _ = decode_rows(q, rows, scale, tilted)
    pools, plan = _layer_pools(rows, tilted, shared, rng)
    got = cpu_decode.decode_plan(q, pools, plan, scale, tilted)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_plan_with_page_bounds_and_given_clusters(dtype):
    """Quest's page bounds (scoring rows 2D wide) and clusters given by the policy (the plan's
    retrieval column of each row's, -1 past it) read from the layer's pools equal the
    per-row kernel's; a given id outside the row's clusters is named."""
    rng = torch.Generator().manual_seed(5)
    h, d = 2, 64
    rows = [_row(h, d, c, 4, 20, dtype, rng, paged) for c, paged in
            ((200, True), (90, False), (40, True))]
    q = torch.randn(3, 8, d, generator=rng).to(dtype)
    bounds = [dataclasses.replace(
        r, centroids=torch.cat([r.centroids, r.centroids - 1], -1), n_estimation=0)
        for r in rows]
    want, _, _ = decode_rows(q, bounds, 0.125, False)
    pools, plan = _layer_pools(bounds, False, True, rng, scoring_width=2 * d)
    torch.testing.assert_close(cpu_decode.decode_plan(q, pools, plan, 0.125, False), want,
                               rtol=0, atol=0)
    counts = (17, 0, 40)
    given = torch.full((3, h, 40), -1, dtype=torch.int64)
    for b, (r, n) in enumerate(zip(rows, counts, strict=True)):
        for hh in range(h):
            given[b, hh, :n] = torch.randperm(r.centroids.shape[1], generator=rng)[:n]
    want, _, _ = cpu_decode.decode_packed(
        q, [cpu_decode.pack_row(r, False) for r in rows], 0.125, False,
        given=[given[b, :, :n] for b, n in enumerate(counts)])
    pools, plan = _layer_pools(rows, False, False, rng)
    plan[3] = torch.tensor(counts)
    plan[4] = 0
    got = cpu_decode.decode_plan(q, pools, plan, 0.125, False, given=given)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    bad = given.clone()
    bad[2, 1, 3] = 40
    with pytest.raises(RuntimeError, match="given cluster id is out of range: 40"):
        cpu_decode.decode_plan(q, pools, plan, 0.125, False, given=bad)


def test_decode_plan_names_a_plan_outside_the_layer():
    """A plan column pointing outside the layer's pools is refused, naming the value and the
    bound; nothing is read."""
    rng = torch.Generator().manual_seed(6)
    rows = [_row(2, 64, 30, 4, 20, torch.float32, rng, True) for _ in range(2)]
    q = torch.randn(2, 4, 64, generator=rng)
    pools, plan = _layer_pools(rows, True, True, rng)
    for field, value, message in ((0, 99, "slot 99"), (1, 50, "steady slot 50"),
                                  (9, 10 ** 6, "outside the meta pool"),
                                  (7, 10 ** 4, "steady zone out of range")):
        bad = plan.clone()
        bad[field, 1] = value
        with pytest.raises(RuntimeError, match=message):
            cpu_decode.decode_plan(q, pools, bad, 0.125, True)
