"""kernels.cluster_cache: the in-place step's device cache of retrieval clusters — the
lookup's LRU admission by hand, Triton against the torch reference over many steps, and the
attention through the cache equal to the attention without it."""

import pytest
import torch

from tests.helpers import slot_meta
from vllm_retro.kernels.cluster_cache import (
    ClusterCache,
    cache_lookup_torch,
    cache_lookup_triton,
)
from vllm_retro.kernels.resident_attention import (
    RETRIEVAL_MAPS,
    LayerPools,
    resident_attention_torch,
    resident_attention_triton,
)
from vllm_retro.kernels.step_plan import PLAN_FIELDS, plan_rows


def _plan(slots, n_ret, step, clusters=None, heads=1, cap=10):
    fields = {"slot": slots, "retrieval": n_ret, "step": [step] * len(slots),
              "clusters": clusters if clusters is not None else n_ret}
    fields["meta_row"], fields["meta_stride"] = slot_meta(torch.tensor(slots), heads, cap)
    return torch.stack([torch.as_tensor(fields.get(k, [0] * len(slots)))
                        for k in PLAN_FIELDS]).long()


def _cache(rows, clusters, blocks, t, d=8, dtype=torch.float32, dev="cpu"):
    return ClusterCache.allocate(rows, clusters, blocks, t, d, dtype, dev)


def test_lookup_admits_misses_into_the_least_recently_used_blocks():
    """One slot, one KV head, 3 blocks of 4 tokens, clusters of sizes 0..9."""
    cache = _cache(1, 10, 3, 4)
    sizes = torch.arange(10, dtype=torch.int32)[None]
    top = lambda *ids: torch.tensor([list(ids)])  # noqa: E731

    runs = cache_lookup_torch(cache, sizes, _plan([0], [2], 1), top(5, 6, 9), 3)
    assert runs[0].tolist() == [[0, 4, -1]] and runs[1].tolist() == [[0, 0, 0]]
    assert cache.block_of[0, :10].tolist() == [-1] * 5 + [0, 1, -1, -1, -1]
    assert cache.cluster_of[0, :3].tolist() == [5, 6, -1]
    assert cache.counts[0].tolist() == [0, 11, 0, 2]  # both read over the bus (5 + 6 tokens)

    # 6 hits (block 1); 7 is admitted into the free block 2, not block 0 (stamp 1 > 0)
    runs = cache_lookup_torch(cache, sizes, _plan([0], [2], 2), top(6, 7), 2)
    assert runs.tolist() == [[[4, 8]], [[1, 0]]]
    assert cache.cluster_of[0, :3].tolist() == [5, 6, 7]
    assert cache.stamp[0, :3].tolist() == [1, 2, 2]
    assert cache.counts[0].tolist() == [4, 11 + 2 + 7, 1, 3]  # 6: its first 4 cached, 2 + 7

    # 8 and 9 miss: block 0 (stamp 1), then block 1 (stamp 2, before block 2 by index)
    runs = cache_lookup_torch(cache, sizes, _plan([0], [2], 3), top(9, 8), 2)
    assert runs.tolist() == [[[0, 4]], [[0, 0]]]
    assert cache.cluster_of[0, :3].tolist() == [9, 8, 7]
    assert cache.block_of[0, :10].tolist() == [-1] * 7 + [2, 1, 0]

    # 7 hits; 3 misses and only 2 blocks no hit of the step holds: the third is not admitted
    runs = cache_lookup_torch(cache, sizes, _plan([0], [4], 4), top(1, 7, 2, 3), 4)
    assert runs.tolist() == [[[0, 8, 4, -1]], [[0, 1, 0, 0]]]
    assert cache.cluster_of[0, :3].tolist() == [1, 2, 7]
    assert cache.block_of[0, :10].tolist() == [-1, 0, 1, -1, -1, -1, -1, 2, -1, -1]


def _tables(cache, clusters):
    return (cache.block_of[:, :clusters], cache.cluster_of[:, :cache.blocks],
            cache.stamp[:, :cache.blocks], cache.counts)


def _consistent(cache, clusters):
    """block_of and cluster_of are each other's inverse."""
    for p in range(cache.block_of.shape[0]):
        for c in range(clusters):
            b = int(cache.block_of[p, c])
            assert b < 0 or int(cache.cluster_of[p, b]) == c
        for b in range(cache.blocks):
            c = int(cache.cluster_of[p, b])
            assert c < 0 or int(cache.block_of[p, c]) == b


@pytest.mark.parametrize("blocks", [5, 40])
def test_triton_lookup_matches_torch_over_many_steps(blocks, triton_device):
    """Three requests (slots 2, 0, 1; 2 KV heads), ragged retrieval zones drawn with a bias
    (so clusters recur), 12 steps: the same runs, tables and counters in both."""
    gen = torch.Generator().manual_seed(0)
    h, slots, c_cap, r_max, t = 2, 3, 60, 9, 8
    sizes = torch.randint(0, 20, (slots * h, c_cap), generator=gen, dtype=torch.int32)
    ref, tri = _cache(slots * h, c_cap, blocks, t), _cache(slots * h, c_cap, blocks, t,
                                                              dev=triton_device)
    weights = torch.linspace(3.0, 0.1, c_cap)
    for step in range(1, 13):
        n_ret = torch.randint(0, r_max + 1, (3,), generator=gen).tolist()
        plan = _plan([2, 0, 1], n_ret, step, heads=h, cap=c_cap)
        top = torch.stack([torch.multinomial(weights, r_max, generator=gen)
                           for _ in range(3 * h)])
        want = cache_lookup_torch(ref, sizes, plan, top, r_max)
        got = cache_lookup_triton(tri, sizes.to(triton_device), plan.to(triton_device),
                                  top.to(triton_device), r_max).cpu()
        rows = plan_rows(plan, h)
        keep = torch.arange(r_max)[None, :] < rows.n_ret[:, None]
        torch.testing.assert_close(got * keep, want * keep, rtol=0, atol=0)
        for a, b in zip(_tables(tri, c_cap), _tables(ref, c_cap), strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
        _consistent(ref, c_cap)
    assert int(ref.counts[:, 0].sum()) > 0 and int(ref.counts[:, 1].sum()) > 0


def test_allocate_refuses_bad_bounds():
    with pytest.raises(ValueError, match="blocks=0; accepted: an integer >= 1"):
        ClusterCache.allocate(2, 10, 0, 16, 8, torch.float32, "cpu")
    assert ClusterCache.footprint(3, 10, 4, 16, 8, torch.bfloat16) == \
        _cache(3, 10, 4, 16, dtype=torch.bfloat16).nbytes()


def _step_case(gen, dtype, steps=6, h=2, slots=3, c_cap=40, n_cap=400, d=32, g=4, r_max=5,
               e_max=6):
    """A layer's pools (every slot 40 clusters of 0-23 tokens, some larger than a block)
    and ``steps`` plans and rankings whose retrieval zones overlap from step to step."""
    p = slots * h
    sizes = torch.randint(0, 24, (p, c_cap), generator=gen, dtype=torch.int32)
    starts = sizes.long().cumsum(1) - sizes.long()
    f = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    pools = LayerPools(
        keys=f(p, n_cap * 3, d).to(dtype), values=f(p, n_cap * 3, d).to(dtype),
        centroids=f(p, c_cap, d).to(dtype), value_sums=(3 * f(p, c_cap, d)).to(dtype),
        sizes=sizes, starts=starts, spreads=f(p, c_cap).abs(),
        deviates=0.5 + f(p, c_cap).abs(), profile=f(p, d).abs() / d,
        key_factor=f(p, d, 2) / d ** 0.5, value_factor=f(p, d, 2) / d ** 0.5,
        steady_k=f(slots, 4 + 16, h, d).to(dtype), steady_v=f(slots, 4 + 16, h, d).to(dtype),
        sink_cap=4)
    weights = torch.linspace(4.0, 0.1, c_cap)
    cases = []
    for step in range(1, steps + 1):
        fields = {"slot": [1, 2, 0], "steady_slot": [0, 1, 2], "clusters": [c_cap] * 3,
                  "retrieval": [r_max, 3, 0], "estimation": [e_max] * 3, "sinks": [4, 1, 0],
                  "ring_start": [3, 0, 9], "window": [16, 5, 10], "step": [step] * 3}
        fields["meta_row"], fields["meta_stride"] = slot_meta(torch.tensor([1, 2, 0]), h,
                                                              c_cap)
        plan = torch.stack([torch.as_tensor(fields[k]) for k in PLAN_FIELDS]).long()
        top = torch.stack([torch.multinomial(weights, r_max + e_max, generator=gen)
                           for _ in range(3 * h)])
        cases.append((f(3 * h, g, d).to(dtype), plan, top))
    width = 20 + r_max * 24
    return pools, cases, width, r_max, e_max


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("retrieval_map", RETRIEVAL_MAPS)
def test_attention_through_the_cache_equals_attention_without_it(dtype, tol, retrieval_map,
                                                                 triton_device):
    """Step after step (hits, admissions, evictions, clusters larger than a block), both
    paths through a cache of 4 blocks of 8 tokens give the attention the pools give alone,
    and every cached block holds its cluster's first tokens."""
    gen = torch.Generator().manual_seed(1)
    pools, cases, width, r_max, e_max = _step_case(gen, dtype)
    p, d = pools.sizes.shape[0], pools.keys.shape[2]
    dev = triton_device
    on_dev = LayerPools(**{k: v.to(dev) if isinstance(v, torch.Tensor) else v
                           for k, v in vars(pools).items()})
    ref_cache = _cache(p, 40, 4, 8, d, dtype)
    tri_cache = _cache(p, 40, 4, 8, d, dtype, dev)
    for q, plan, top in cases:
        plain = resident_attention_torch(q, pools, plan, top, width, r_max, e_max, 0.125)
        runs = cache_lookup_torch(ref_cache, pools.sizes, plan, top, r_max)
        got = resident_attention_torch(q, pools, plan, top, width, r_max, e_max, 0.125,
                                       cache=ref_cache, runs=runs)
        torch.testing.assert_close(got, plain, rtol=0, atol=0)
        runs = cache_lookup_triton(tri_cache, on_dev.sizes, plan.to(dev), top.to(dev), r_max)
        got = resident_attention_triton(q.to(dev), on_dev, plan.to(dev), top.to(dev), width,
                                        r_max, e_max, 0.125, cache=tri_cache,
                                        runs=runs, retrieval_map=retrieval_map).cpu()
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), plain.float(), rtol=tol, atol=tol)
    assert int(ref_cache.counts[:, 0].sum()) > 0  # some tokens were read from the cache
    for cache in (ref_cache, tri_cache):
        cache = ClusterCache(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                for k, v in vars(cache).items()})
        filled = 0
        for row in range(p):
            for b in range(cache.blocks):
                c = int(cache.cluster_of[row, b])
                if c < 0:
                    continue
                n = min(int(pools.sizes[row, c]), 8)
                s0 = int(pools.starts[row, c])
                at = (row * cache.blocks + b) * 8
                assert torch.equal(cache.keys[at:at + n], pools.keys[row, s0:s0 + n])
                assert torch.equal(cache.values[at:at + n], pools.values[row, s0:s0 + n])
                filled += 1
        assert filled >= p // 2
