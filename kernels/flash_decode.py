"""Dense decode attention, split along the keys (flash-decoding): the second dense baseline.

One query token per request over its whole KV, grouped-query: query head ``j`` reads KV head
``j // G`` (``G = Hq / H``), as SDPA with ``enable_gqa`` does. 16-bit keys and values
multiply on tensor cores as tf32, which holds them exactly (the query unscaled, so it is
exact too; the probabilities round to tf32, finer than FlashAttention's bf16), with fp32
sums; fp32 ones in IEEE fp32. The GPU benchmarks time it next to
PyTorch's SDPA and report the faster as dense (``bench/device_step.py``): at decode, with
one query row per head, a kernel split over the keys across every SM can beat a library
kernel tuned for prefill.

Two launches: the split kernel (programs over (request x KV head, split of the keys), each an
online softmax over its keys for the head's ``G`` query heads) and
:func:`~vllm_retro.kernels.tripartite_attention.merge_splits`.
"""

from __future__ import annotations

import torch

from vllm_retro.kernels._common import block_size, check_float, tl, triton
from vllm_retro.kernels.tripartite_attention import (
    merge_splits,
    online_softmax_step,
    store_partials,
)


def flash_decode_ref(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """query [B, Hq, D]; keys, values [B, H, N, D]; Hq a multiple of H. Softmax attention
    in fp32; returns [B, Hq, D] in the query's dtype."""
    b, hq, d = query.shape
    h = keys.shape[1]
    q = query.float().reshape(b, h, hq // h, d)
    logits = torch.einsum("bhgd,bhnd->bhgn", q, keys.float()) * scale
    out = torch.einsum("bhgn,bhnd->bhgd", logits.softmax(-1), values.float())
    return out.reshape(b, hq, d).to(query.dtype)


@triton.jit
def _flash_split_kernel(
    Q, K, V, ACC, MX, LS,
    G, D, N, chunk, scale,
    sq_r, sq_g, sk_r, sk_n, sv_r, sv_n, sacc_r, sacc_s, sacc_g, sm_r, sm_s,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r = tl.program_id(0)  # request x KV head
    sp = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(Q + r * sq_r + offs_g[:, None] * sq_g + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    ssum = tl.zeros([BLOCK_G], tl.float32)
    racc = tl.zeros([BLOCK_G], tl.float32)  # (the tilted estimator's; unused here)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = sp * chunk
    end = tl.minimum(start + chunk, N)
    for off in range(start, end, BLOCK_N):
        pos = off + tl.arange(0, BLOCK_N)
        valid = pos < end
        m2 = valid[:, None] & dmask[None, :]
        k = tl.load(K + r * sk_r + pos[:, None] * sk_n + offs_d[None, :], mask=m2, other=0.0)
        v = tl.load(V + r * sv_r + pos[:, None] * sv_n + offs_d[None, :], mask=m2, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m, ssum, racc, acc = online_softmax_step(m, ssum, racc, acc, s, v.to(tl.float32),
                                                 racc, False, PRECISION)
    store_partials(ACC, MX, LS, LS, r * sacc_r + sp * sacc_s, r * sm_r + sp * sm_s, sacc_g,
                   offs_g, offs_d, gmask, dmask, acc, m, ssum, racc, False)


def flash_decode_triton(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Triton version of :func:`flash_decode_ref` (same arguments and result; keys and
    values may be strided views with contiguous rows). ``num_splits`` (default: enough
    programs for a large GPU) splits every row's keys."""
    check_float("query", query)
    check_float("keys", keys)
    b, hq, d = query.shape
    h, n = keys.shape[1], keys.shape[2]
    g = hq // h
    r = b * h
    out = torch.empty_like(query)
    if r == 0:
        return out
    if keys.stride(3) != 1 or values.stride(3) != 1 or keys.stride(0) != h * keys.stride(1) \
            or values.stride(0) != h * values.stride(1):
        keys, values = keys.contiguous(), values.contiguous()
    block_d = block_size(d)
    block_n = 64 if block_d <= 64 else (32 if block_d <= 128 else 16)
    splits = num_splits or max(1, min(triton.cdiv(528, r), triton.cdiv(max(n, 1), block_n)))
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(n, 1), splits), block_n) * block_n)
    splits = triton.cdiv(max(n, 1), chunk)
    q = query.reshape(r, g, d)
    acc = torch.empty(r, splits, g, d, dtype=torch.float32, device=query.device)
    mx = torch.empty(r, splits, g, dtype=torch.float32, device=query.device)
    ls = torch.empty(r, splits, g, dtype=torch.float32, device=query.device)
    _flash_split_kernel[(r, splits)](
        q, keys, values, acc, mx, ls,
        g, d, n, chunk, float(scale),
        q.stride(0), q.stride(1), keys.stride(1), keys.stride(2), values.stride(1),
        values.stride(2), acc.stride(0), acc.stride(1), acc.stride(2), mx.stride(0),
        mx.stride(1),
        BLOCK_G=block_size(g), BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if keys.dtype == torch.float32 else "tf32",
    )
    merge_splits(acc, mx, ls, None, None, out.view(r, g, d))
    return out
