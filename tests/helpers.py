"""Shared test helpers: dense reference attention, error metrics, random wave indexes."""

from __future__ import annotations

import torch


def full_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float | None = None, positions: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Exact softmax attention of query [Hq, D] over keys/values [Hkv, N, D] in fp64.

    ``positions`` [Hkv, T] (-1 = padding) restricts each KV head to those tokens.
    Returns [Hq, D] float64.
    """
    hq, d = query.shape
    hkv = keys.shape[0]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    k = keys.double().repeat_interleave(g, 0)
    v = values.double().repeat_interleave(g, 0)
    s = torch.einsum("hd,hnd->hn", query.double(), k) * scale
    if positions is not None:
        mask = torch.zeros(hkv, keys.shape[1], dtype=torch.bool)
        for h in range(hkv):
            p = positions[h][positions[h] >= 0]
            mask[h, p] = True
        s = s.masked_fill(~mask.repeat_interleave(g, 0), float("-inf"))
    return torch.einsum("hn,hnd->hd", s.softmax(-1), v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ||out - ref|| / ||ref|| (NaN never passes a < comparison)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def random_indexes(lengths: list[int], config, heads: int, head_dim: int, dtype: torch.dtype,
                   generator: torch.Generator, manager=None, layer: str | None = "L0",
                   first: int = 0) -> list:
    """Wave indexes over random KV of the given context lengths ([heads, n, head_dim] each),
    over wave buffer stores of ``manager`` (requests 'r<first>', 'r<first + 1>', ..., in the
    pools of ``layer``; None: pools of their own) or dense stores."""
    from vllm_retro.index import WaveIndex

    out = []
    for i, n in enumerate(lengths, start=first):
        k = torch.randn(heads, n, head_dim, generator=generator).to(dtype)
        v = torch.randn(heads, n, head_dim, generator=generator).to(dtype)
        store = manager.store(f"r{i}", heads, head_dim, dtype, "cpu", layer=layer) \
            if manager else None
        out.append(WaveIndex.build(k, v, config, store=store))
    return out


def batched_equals_alone(indexes: list, manager, gen: torch.Generator, query_heads: int,
                         steps: int = 200, every: int = 7, tol: float = 1e-5,
                         check=None) -> None:
    """Decode ``steps`` tokens for a layer's ``indexes`` at once (``append_batch`` then
    ``decode_batch``, as the route does) and, every ``every`` steps, check each row against
    its index decoding alone (atol = rtol = ``tol``, no NaN). Then ``check(indexes)`` (a
    predicate, if given) is true, the stores' invariants hold and, once every index is
    freed and ``manager`` closed, no byte is left."""
    from vllm_retro.index.batched import append_batch, decode_batch
    from vllm_retro.index.padded import MetaViewCache

    first = indexes[0]
    h, d, dtype, b = first.num_kv_heads, first.head_dim, first.centroids.dtype, len(indexes)
    views = MetaViewCache()
    for step in range(steps):
        keys, values = torch.randn(2, b, h, d, generator=gen).to(dtype)
        append_batch(indexes, keys, values)
        q = torch.randn(b, query_heads, d, generator=gen).to(dtype)
        got = decode_batch(indexes, q, d ** -0.5, cache=views)
        if step % every == 0:
            for r, index in enumerate(indexes):
                want = index.decode(q[r], d ** -0.5).output
                assert not got[r].isnan().any()
                torch.testing.assert_close(got[r], want, atol=tol, rtol=tol)
    views.clear()
    assert check is None or check(indexes)
    for index in indexes:
        index.store.check_invariants()
        index.free()
    manager.close()
    assert manager.host_bytes() == 0


def decode_steps(index, keys: torch.Tensor, values: torch.Tensor, query_heads: int,
                 steps: int, gen: torch.Generator, check, every: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``steps`` random tokens as the engine does: append the token's K/V
    ([H, 1, D] fp32) to ``index``, then decode its query ([query_heads, D]). Every ``every``
    steps ``check(keys, values, query)`` gets the whole context so far ([H, N, D] each);
    the other steps only decode. Returns the grown (keys, values)."""
    h, _, d = keys.shape
    for step in range(steps):
        nk, nv = torch.randn(h, 1, d, generator=gen), torch.randn(h, 1, d, generator=gen)
        index.append(nk, nv)
        keys, values = torch.cat([keys, nk], 1), torch.cat([values, nv], 1)
        q = torch.randn(query_heads, d, generator=gen)
        if step % every == 0:
            check(keys, values, q)
        else:
            index.decode(q, d ** -0.5)
    return keys, values


def equivalence_cases(shapes: list[tuple[int, int]], stores: list) -> list:
    """``pytest.param``s (dtype, tol, estimator, store, group, head_dim) for the decode
    paths' equivalence tests against the per-row reference: the tilted estimator (the
    default) in fp32 and bf16 at every (query group, head_dim) shape with every store; the
    centroid estimator (fp32, bf16) and 'auto' (fp32; heads set apart per row, as builds
    judge them) with every store at one shape, the middle one: the estimator's terms do not
    depend on the shape, and the full cross (100 cases in three files) took ~23 of the
    suite's worker-minutes on 2 cores (~8 now)."""
    import pytest

    tilted = [(torch.float32, 1e-5, "tilted"), (torch.bfloat16, 1e-2, "tilted")]
    others = [(torch.float32, 1e-5, "centroid"), (torch.bfloat16, 1e-2, "centroid"),
              (torch.float32, 1e-5, "auto")]
    mid = shapes[len(shapes) // 2]
    return [pytest.param(dtype, tol, est, store, g, d,
                         id=f"{g}-{d}-{store}-{str(dtype).split('.')[-1]}-{est}")
            for g, d in shapes for store in stores
            for dtype, tol, est in tilted + (others if (g, d) == mid else [])]


def as_meta_pool(fields: dict[str, torch.Tensor], heads: int, clusters: list[int],
                 gen: torch.Generator) -> tuple[dict[str, torch.Tensor], list[int], int]:
    """Meta rows laid out per (slot, head) (``[slots * heads, C, ...]`` each, as a device
    layer's own pool) moved into a layer meta pool's layout (``[heads, capacity, ...]``,
    slot s's rows in an extent of ``clusters[s]`` rows at a shuffled start, gaps between
    extents, the last extent ending the pool): what lies outside an extent (the gaps, and
    the columns past a slot's clusters) is NaN, or 1 for integer fields, so a kernel
    reading it is caught. Returns (fields in the new layout, each slot's extent start,
    the capacity): the plan's ``meta_row`` and ``meta_stride``."""
    slots = len(clusters)
    order = torch.randperm(slots, generator=gen).tolist()
    starts, at = [0] * slots, 3
    for s in order:
        starts[s] = at
        at += clusters[s] + 2
    cap = at - 2  # no room after the last extent
    out = {}
    for name, x in fields.items():
        trail = x.shape[2:]
        fill = float("nan") if x.is_floating_point() else 1
        pool = torch.full((heads, cap, *trail), fill, dtype=x.dtype)
        rows = x.view(slots, heads, x.shape[1], *trail)
        for s, (start, n) in enumerate(zip(starts, clusters, strict=True)):
            pool[:, start:start + n] = rows[s, :, :n]
        out[name] = pool
    return out, starts, cap


def slot_meta(slots: torch.Tensor, heads: int, columns: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A step plan's (meta_row, meta_stride) for requests in ``slots`` ([B] int64) of meta
    rows laid out ``[slots x heads, columns, ...]`` (row ``slot * heads + head``)."""
    return slots * heads * columns, torch.full_like(slots, columns)
