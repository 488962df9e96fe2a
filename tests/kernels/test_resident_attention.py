"""kernels.resident_attention: tripartite decode read in place from a layer's pools, Triton
vs the torch reference (which packs an execution buffer), on ragged random rows."""

import pytest
import torch

from vllm_retro.kernels.resident_attention import (
    BatchRows,
    LayerPools,
    resident_attention_torch,
    resident_attention_triton,
    retrieval_runs,
)
from vllm_retro.kernels.tripartite_attention import tripartite_decode_ref


def _case(gen, dtype, g=4, d=64, h=2, slots=3, n_cap=300, c_cap=40, sink_cap=4, ring=24):
    """Random pools and a batch of every slot's rows: clusters of ragged sizes (some empty)
    per pool row, a window wrapping the ring, a row with no clusters."""
    p = slots * h
    sizes = torch.zeros(p, c_cap, dtype=torch.int32)
    starts = torch.zeros(p, c_cap, dtype=torch.int64)
    counts = [c_cap, 17, 0]  # clusters per slot
    for row in range(p):
        c = counts[row // h]
        sz = torch.randint(0, 12, (c,), generator=gen).to(torch.int32)
        sizes[row, :c] = sz
        starts[row, :c] = sz.long().cumsum(0) - sz.long()
    f = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    pools = LayerPools(
        keys=f(p, n_cap, d).to(dtype), values=f(p, n_cap, d).to(dtype),
        centroids=f(p, c_cap, d).to(dtype), value_sums=(3 * f(p, c_cap, d)).to(dtype),
        sizes=sizes, starts=starts, spreads=f(p, c_cap).abs(),
        deviates=0.5 + f(p, c_cap).abs(), steady_k=f(slots, sink_cap + ring, h, d).to(dtype),
        steady_v=f(slots, sink_cap + ring, h, d).to(dtype), sink_cap=sink_cap)
    order = [2, 0, 1]  # batch row b -> slot
    b = len(order)
    r = b * h
    head = torch.arange(h).repeat(b)
    slot = torch.tensor(order).repeat_interleave(h)
    pool_row = slot * h + head
    n_cl = torch.tensor(counts)[slot]
    k_top = 12
    scores = torch.rand(r, c_cap, generator=gen)
    scores = scores.masked_fill(torch.arange(c_cap)[None, :] >= n_cl[:, None], -1.0)
    top = scores.topk(k_top, dim=1).indices
    n_ret = torch.minimum(n_cl, torch.tensor(3))
    n_est = torch.minimum(n_cl - n_ret, torch.tensor(k_top - 3))
    sinks = torch.tensor([4, 2, 0]).repeat_interleave(h)
    window = torch.tensor([20, 24, 5]).repeat_interleave(h)
    ring_start = torch.tensor([17, 0, 22]).repeat_interleave(h)  # slot 0 wraps the ring
    ends, offs = retrieval_runs(pools, pool_row, top, n_ret, 3)
    rows = BatchRows(pool_row=pool_row, steady_slot=slot, head=head, sinks=sinks,
                     ring_start=ring_start, n_steady=sinks + window, top=top, n_ret=n_ret,
                     n_est=n_est, ends=ends, offs=offs)
    width = int((sinks + window + ends[:, -1]).max()) + 5
    q = f(r, g, d).to(dtype)
    tilt = (f(r, g).abs() * 0.3, 0.1 * f(r, g, d))
    return q, pools, rows, width, k_top - 3, tilt


def test_torch_path_reads_the_tokens_the_module_describes():
    """The reference against a hand-assembled token list per row."""
    gen = torch.Generator().manual_seed(0)
    q, pools, rows, width, e_max, _ = _case(gen, torch.float64)
    got = resident_attention_torch(q, pools, rows, width, e_max, 0.125)
    ring = pools.steady_k.shape[1] - pools.sink_cap
    for r in range(q.shape[0]):
        slot, head, prow = int(rows.steady_slot[r]), int(rows.head[r]), int(rows.pool_row[r])
        sinks, nst = int(rows.sinks[r]), int(rows.n_steady[r])
        zr = list(range(sinks)) + [pools.sink_cap + (int(rows.ring_start[r]) + i) % ring
                                   for i in range(nst - sinks)]
        ks = [pools.steady_k[slot, z, head] for z in zr]
        vs = [pools.steady_v[slot, z, head] for z in zr]
        for c in rows.top[r, :int(rows.n_ret[r])].tolist():
            s0, n = int(pools.starts[prow, c]), int(pools.sizes[prow, c])
            ks += list(pools.keys[prow, s0:s0 + n])
            vs += list(pools.values[prow, s0:s0 + n])
        est = rows.top[r, int(rows.n_ret[r]):int(rows.n_ret[r] + rows.n_est[r])]
        k = torch.stack(ks)[None]
        v = torch.stack(vs)[None]
        want, _ = tripartite_decode_ref(
            q[r:r + 1], k, v, torch.tensor([k.shape[1]]), pools.centroids[prow:prow + 1],
            pools.value_sums[prow:prow + 1], pools.sizes[prow:prow + 1], est[None],
            torch.tensor([est.numel()]), 0.125)
        torch.testing.assert_close(got[r], want[0], rtol=1e-5, atol=1e-5)  # both in fp32


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tilted", [True, False])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_triton_matches_torch(dtype, tol, tilted, splits, triton_device):
    gen = torch.Generator().manual_seed(1)
    q, pools, rows, width, e_max, tilt = _case(gen, dtype)
    tilt = tilt if tilted else None
    ref = resident_attention_torch(q, pools, rows, width, e_max, 0.125, tilt)
    dev = triton_device
    mv = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t  # noqa: E731
    got = resident_attention_triton(
        q.to(dev), LayerPools(**{k: mv(v) for k, v in vars(pools).items()}),
        BatchRows(**{k: mv(v) for k, v in vars(rows).items()}), width, e_max, 0.125,
        None if tilt is None else tuple(t.to(dev) for t in tilt), num_splits=splits).cpu()
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_nan_query_row_stays_in_its_row(triton_device):
    gen = torch.Generator().manual_seed(2)
    q, pools, rows, width, e_max, tilt = _case(gen, torch.float32)
    q[1, 2, 7] = float("nan")
    dev = triton_device
    mv = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t  # noqa: E731
    clean = resident_attention_torch(q.nan_to_num(), pools, rows, width, e_max, 0.125, tilt)
    for fn in (resident_attention_torch, resident_attention_triton):
        got = fn(q.to(dev), LayerPools(**{k: mv(v) for k, v in vars(pools).items()}),
                 BatchRows(**{k: mv(v) for k, v in vars(rows).items()}), width, e_max, 0.125,
                 tuple(t.to(dev) for t in tilt)).cpu()
        others = [i for i in range(q.shape[0]) if i != 1]
        torch.testing.assert_close(got[others], clean[others], rtol=1e-5, atol=1e-5)
