"""Baseline selection policies sharing the wave index's machinery (steady zone, store,
decode kernel); only how the exactly-read tokens are chosen differs. None has an estimation
zone (the paper's peers have none).

- ``quest``: Quest's pages of contiguous tokens ranked by the per-dimension min/max upper
  bound of ``q . k`` (Tang et al., 2024): the serving index itself,
  :class:`~vllm_retro.index.pages.QuestIndex`;
- ``pqcache``: tokens ranked by product-quantised ``q . k_hat`` (Zhang et al., 2025): the
  serving index itself, :class:`~vllm_retro.index.pq_index.PQIndex`;
- ``streaming``: StreamingLLM (Xiao et al., 2024), sinks plus a local window widened by
  the budget (the most recent pages): the serving index,
  :class:`~vllm_retro.index.pages.StreamingIndex`;
- :class:`OracleIndex`: the exact top tokens by ``q . k``, an upper bound for token selection.

**The budget rule.** Every method attends exactly the same steady zone (first
``sink_tokens``, last ``local_window`` + not-yet-indexed tokens) plus ``token_budget`` indexed
tokens per KV head, set with ``set_token_budget``. The functional entry points default it to
:func:`retrieval_token_budget`, the expected size of the wave index's retrieval zone for the
same config; the attention-level comparison (:mod:`vllm_retro.index.compare`) matches, per
decode step, the tokens the wave index actually retrieved (mean over KV heads). Quest reads
whole pages: ``round(token_budget / page_size)`` of them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vllm_retro import kernels
from vllm_retro.config import RetroConfig
from vllm_retro.index.clustering import Clusters, clusters_per_segment, residual_moments
from vllm_retro.index.functional import validate_qkv
from vllm_retro.index.pages import QuestIndex, StreamingIndex
from vllm_retro.index.pq_index import PQIndex
from vllm_retro.index.store import ClusterStore
from vllm_retro.index.wave_index import Selection, WaveIndex


def page_clusters(keys: torch.Tensor, values: torch.Tensor, page_size: int) -> Clusters:
    """Cut a block into contiguous pages, each a 'cluster'. keys, values: [H, M, D]."""
    h, m, d = keys.shape
    p = math.ceil(m / page_size)
    pad = p * page_size - m
    sizes = torch.full((p,), page_size, dtype=torch.int32, device=keys.device)
    sizes[-1] = m - (p - 1) * page_size
    ks = torch.nn.functional.pad(keys.float(), (0, 0, 0, pad)).reshape(h, p, page_size, d)
    vs = torch.nn.functional.pad(values.float(), (0, 0, 0, pad)).reshape(h, p, page_size, d)
    offsets = torch.zeros(p + 1, dtype=torch.int64, device=keys.device)
    offsets[1:] = sizes.to(torch.int64).cumsum(0)
    kmean = ks.sum(2) / sizes[None, :, None]
    slot = torch.arange(p * page_size, device=keys.device)
    assign = torch.where(slot < m, slot // page_size, -1)[None, :].expand(h, -1)
    spread, key_sq, cross = residual_moments(ks.reshape(h, -1, d), vs.reshape(h, -1, d), assign,
                                             kmean, vs.sum(2) / sizes[None, :, None])
    return Clusters(
        centroids=kmean.to(keys.dtype),
        value_sums=vs.sum(2).to(values.dtype),
        sizes=sizes[None, :].expand(h, p).contiguous(),
        spreads=spread / sizes[None, :],
        key_sq=key_sq,
        cross=cross,
        order=torch.arange(m, device=keys.device)[None, :].expand(h, m).contiguous(),
        offsets=offsets[None, :].expand(h, p + 1).contiguous(),
    )


class TokenIndex(WaveIndex):
    """Base of the token-granular baselines: every indexed token is its own one-token
    'cluster' (ids in position order), so the store, steady zone and decode kernel are the
    wave index's; a subclass ranks the indexed tokens in :meth:`token_scores` and the top
    ``token_budget`` of them are read exactly."""

    clusters_in_rounds = False
    selects_zones = False
    kernel_scores = False

    def __init__(self, config: RetroConfig, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, store: ClusterStore | None = None):
        super().__init__(config, num_kv_heads, head_dim, dtype, device, store)
        self.token_budget = 0  # indexed tokens read exactly per decode step and KV head

    def _cluster(self, keys: torch.Tensor, values: torch.Tensor, update: bool) -> Clusters:
        return page_clusters(keys, values, 1)

    def set_token_budget(self, tokens: int) -> None:
        """Read the top ``tokens`` indexed tokens (per KV head) at each decode step."""
        self.token_budget = max(0, int(tokens))

    def token_scores(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Rank of every indexed token for query [H, G, D] fp32: [H, N_indexed] (higher is
        read first)."""
        raise NotImplementedError

    def select(self, query: torch.Tensor, scale: float) -> Selection:
        h = self.num_kv_heads
        k = min(self.token_budget, self.num_clusters)
        if k <= 0:
            none = torch.empty(h, 0, dtype=torch.int64, device=query.device)
            return Selection(none, none)
        scores = self.token_scores(query.reshape(h, -1, self.head_dim).float(), scale)
        top = torch.topk(scores, k, dim=1).indices
        return Selection(top, top[:, :0])


class OracleIndex(TokenIndex):
    """The exact top tokens: ranked by the GQA group's summed softmax of the true ``q . k``
    (the wave index's own cluster scoring applied to one-token clusters)."""

    def token_scores(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        return kernels.cluster_scores(query, self._scoring_centroids(), self.sizes, scale,
                                      backend=self.backend)


def retrieval_token_budget(config: RetroConfig, n_indexed: int) -> int:
    """The shared budget rule: indexed tokens each method reads exactly per KV head.

    The expected size of the wave index's retrieval zone over ``n_indexed`` prefill-indexed
    tokens: ``num_retrieval(C)`` clusters of ``n_indexed / C`` tokens on average, ``C`` the
    clusters its segmented clustering makes (one per ``cluster_size`` tokens per segment).
    """
    if n_indexed <= 0:
        return 0
    seg = min(config.segment_size, n_indexed)
    lens = [min(seg, n_indexed - s) for s in range(0, n_indexed, seg)]
    c = sum(clusters_per_segment(lens, config.cluster_size))
    return round(config.num_retrieval(c) * n_indexed / c)


BASELINES: dict[str, type[WaveIndex]] = {
    "quest": QuestIndex,
    "pqcache": PQIndex,
    "streaming": StreamingIndex,
    "oracle": OracleIndex,
}
"""Baseline selection policies by name; each has ``set_token_budget(tokens)``."""


def baseline_attention(
    method: str,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_budget: int | None = None,
    config: RetroConfig | None = None,
    scale: float | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict]:
    """One decode step of a baseline (a name of :data:`BASELINES`) over a context.

    query: [num_heads, head_dim]; keys, values: [num_kv_heads, seq_len, head_dim] post-RoPE,
    the query's own token last (as :func:`vllm_retro.index.sparse_attention`). The steady
    zone of ``config`` plus ``token_budget`` indexed tokens per KV head (default: the shared
    rule :func:`retrieval_token_budget`) are attended exactly; no estimation zone.
    ``options`` go to the index (e.g. ``page_size``, ``subspaces``, ``bits``).

    Returns ``(output [num_heads, head_dim] in query's dtype, stats)``: the stats of
    :func:`vllm_retro.index.sparse_attention` plus ``token_budget``.
    """
    if method not in BASELINES:
        raise ValueError(f"method={method!r}; accepted: {', '.join(BASELINES)}")
    validate_qkv(query, keys, values)
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r} is invalid; accepted: a positive number")
    if token_budget is not None and (isinstance(token_budget, bool)
                                     or not isinstance(token_budget, int) or token_budget < 0):
        raise ValueError(f"token_budget={token_budget!r}; accepted: a non-negative integer")
    config = (config or RetroConfig()).replace(estimation_budget=0.0)
    index = BASELINES[method].build(keys, values, config, **options)
    if token_budget is None:
        token_budget = retrieval_token_budget(config, index.num_tokens - index.num_steady)
    index.set_token_budget(token_budget)  # type: ignore[attr-defined]
    res = index.decode(query, scale)
    return res.output, {**index.zone_stats(res.selection, res.n_exact),
                        "token_budget": token_budget}


def quest_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_budget: int | None = None,
    config: RetroConfig | None = None,
    scale: float | None = None,
    page_size: int = 16,
) -> tuple[torch.Tensor, dict]:
    """Quest-style baseline: the steady zone plus ``round(token_budget / page_size)`` pages
    read exactly. Shapes and ``token_budget`` as :func:`baseline_attention`."""
    config = (config or RetroConfig()).replace(quest_page_size=page_size)
    return baseline_attention("quest", query, keys, values, token_budget, config, scale)


def pqcache_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_budget: int | None = None,
    config: RetroConfig | None = None,
    scale: float | None = None,
    subspaces: int = 2,
    bits: int = 6,
) -> tuple[torch.Tensor, dict]:
    """PQCache-style baseline: the steady zone plus the top ``token_budget`` tokens by
    product-quantised scores (``subspaces`` x ``2 ** bits`` codewords) read exactly.
    Shapes and ``token_budget`` as :func:`baseline_attention`."""
    return baseline_attention("pqcache", query, keys, values, token_budget, config, scale,
                              subspaces=subspaces, bits=bits)


def streaming_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_budget: int | None = None,
    config: RetroConfig | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """StreamingLLM baseline: the sinks and the last ``local_window + token_budget`` tokens.
    Shapes and ``token_budget`` as :func:`baseline_attention`."""
    return baseline_attention("streaming", query, keys, values, token_budget, config, scale)


def oracle_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_budget: int | None = None,
    config: RetroConfig | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Exact top-k oracle: the steady zone plus the ``token_budget`` indexed tokens of the
    highest true attention (GQA group summed). Shapes and ``token_budget`` as
    :func:`baseline_attention`."""
    return baseline_attention("oracle", query, keys, values, token_budget, config, scale)
