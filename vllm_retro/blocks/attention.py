"""Prefill attention under Block-Attention's mask.

A Block-Attention prompt is a sequence of blocks: retrieved passages (and whatever precedes
the first one), then a last block (the question). A passage's token attends only to the
tokens of its own passage up to itself, so a passage's KV depends on its content and
nothing before it and can be cached and reused anywhere; the last block's tokens, and
every decoded token, attend to the whole sequence. Both are one rule: query ``t`` sees keys
``[start[t], pos[t]]``, with ``start`` its passage's first position, or 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vllm_retro.blocks.request import check_blocks


def query_starts(positions: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
    """The first key position each query may see.

    positions: [T] int64 query positions. blocks: the block starts, the last one the last
    block's (the request's ``retro_blocks``: from 0, strictly ascending). Returns [T]
    int64: the start of the block holding each query, 0 from the last block's start on.
    """
    blocks = check_blocks(list(blocks))
    starts = torch.tensor(blocks[:-1], dtype=torch.int64)
    which = torch.searchsorted(starts, positions.to(torch.int64), right=True) - 1
    out = starts[which.clamp_min(0)]
    return torch.where(positions >= blocks[-1], torch.zeros_like(out), out)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    positions: torch.Tensor, starts: torch.Tensor, scale: float
                    ) -> torch.Tensor:
    """Attention of one request's queries under the block mask.

    q: [T, H, D] queries at ``positions`` ([T] int64). k, v: [N, H_kv, D] the request's
    keys and values at positions ``0 .. N-1`` (N > every position; H a multiple of H_kv).
    starts: [T] int64, query ``t`` sees keys ``starts[t] .. positions[t]``
    (:func:`query_starts`). Returns [T, H, D] in q's dtype. Queries sharing a start are
    computed together (one call per block of the chunk).
    """
    t, h, d = q.shape
    n, h_kv, _ = k.shape
    if h % h_kv:
        raise ValueError(f"query heads {h} are not a multiple of KV heads {h_kv}")
    if t and (int(positions.max()) >= n or bool((starts > positions).any())
              or int(starts.min()) < 0):
        raise ValueError(f"positions must be < {n} keys and starts in [0, position]")
    out = torch.empty_like(q)
    group = h // h_kv
    for s in torch.unique(starts).tolist():
        rows = (starts == s).nonzero().flatten()
        pos = positions[rows]
        hi = int(pos.max()) + 1
        keys = torch.arange(s, hi)
        mask = keys[None, :] <= pos[:, None]  # [t_b, n_b]
        qb = q[rows].transpose(0, 1)  # [H, t_b, D]
        kb = k[s:hi].transpose(0, 1).repeat_interleave(group, 0)
        vb = v[s:hi].transpose(0, 1).repeat_interleave(group, 0)
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        out[rows] = ob.transpose(0, 1)
    return out


def block_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              positions: torch.Tensor, starts: torch.Tensor, scale: float
                              ) -> torch.Tensor:
    """:func:`block_attention` as one masked softmax in float64 (for tests)."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,nhd->htn", q.double(), kk) * scale
    j = torch.arange(k.shape[0])
    visible = (j[None, :] >= starts[:, None]) & (j[None, :] <= positions[:, None])
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("htn,nhd->thd", scores.softmax(-1), vv).to(q.dtype)
