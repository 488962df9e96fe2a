"""The functional entry point: sparse attention of one decode query over captured tensors."""

from __future__ import annotations

import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.wave_index import WaveIndex

MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def validate_qkv(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Raise a clear error unless query [Hq, D], keys/values [Hkv, N, D] fit together."""
    for name, t, dims in (("query", query, 2), ("keys", keys, 3), ("values", values, 3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            want = "[num_heads, head_dim]" if dims == 2 else "[num_kv_heads, seq_len, head_dim]"
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {dims} dims {want}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: float32, float16, bfloat16")
    if keys.shape != values.shape:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape"
        )
    if not (query.dtype == keys.dtype == values.dtype):
        raise TypeError(
            f"dtypes differ: query {query.dtype}, keys {keys.dtype}, values {values.dtype}"
        )
    if not (query.device == keys.device == values.device):
        raise ValueError(f"devices differ: query {query.device}, keys {keys.device}, "
                         f"values {values.device}")
    hq, d = query.shape
    hkv, n, dk = keys.shape
    if dk != d:
        raise ValueError(f"head_dim of query ({d}) and keys ({dk}) differ")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={d} is unsupported; accepted: {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    if hkv < 1 or hq < 1 or hq % hkv:
        raise ValueError(f"num_heads={hq} must be a positive multiple of num_kv_heads={hkv}")
    if n < 1:
        raise ValueError(f"seq_len={n}; accepted: at least 1 token")


def sparse_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    config: RetroConfig | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Wave-index attention of one decode query over a context (RetroInfer §4.2).

    query: [num_heads, head_dim] the newest token's post-RoPE query; keys, values:
    [num_kv_heads, seq_len, head_dim] post-RoPE keys and values of the whole context
    (the query's own token included, last). head_dim 32..256; fp32/fp16/bf16; any GQA
    ratio. ``scale`` defaults to ``head_dim ** -0.5``.

    Builds the index (segmented spherical k-means over the middle of the context) and runs
    one tripartite decode step: the steady zone (first ``sink_tokens`` and last
    ``local_window`` tokens) and the retrieval zone (top ``retrieval_budget`` of clusters by
    the group's summed centroid softmax) exactly, the next ``estimation_budget`` of clusters
    estimated by size-weighted centroids, the rest dropped, all merged through log-sum-exp.
    Contexts shorter than ``config.min_indexed_context`` are attended densely (exactly).

    Returns ``(output [num_heads, head_dim] in query's dtype, stats)``; stats holds
    ``n_tokens``, ``dense``, ``n_clusters``, ``n_steady``, ``n_retrieval_clusters``,
    ``n_estimated_clusters``, ``n_exact`` (per KV head: steady + retrieval tokens read
    exactly), ``exact_token_fraction`` and ``estimated_token_fraction`` (means over heads).
    """
    validate_qkv(query, keys, values)
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r} is invalid; accepted: a positive number")
    index = WaveIndex.build(keys, values, config or RetroConfig())
    res = index.decode(query, scale)
    return res.output, index.zone_stats(res.selection, res.n_exact)
