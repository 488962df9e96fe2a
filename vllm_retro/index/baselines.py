"""Baseline selection policies sharing the wave index's machinery (steady zone, store,
decode kernel); only how the exactly-read tokens are chosen differs.

- :class:`QuestIndex`: Quest-style pages of contiguous tokens ranked by the per-dimension
  min/max upper bound of ``q . k`` (Tang et al., 2024), no estimation zone.
"""

from __future__ import annotations

import math

import torch

from kernels.scoring import group_scores_from_logits
from vllm_retro.config import RetroConfig
from vllm_retro.index.clustering import Clusters
from vllm_retro.index.functional import validate_qkv
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
    return Clusters(
        centroids=(ks.sum(2) / sizes[None, :, None]).to(keys.dtype),
        value_sums=vs.sum(2).to(values.dtype),
        sizes=sizes[None, :].expand(h, p).contiguous(),
        order=torch.arange(m, device=keys.device)[None, :].expand(h, m).contiguous(),
        offsets=offsets[None, :].expand(h, p + 1).contiguous(),
    )


class QuestIndex(WaveIndex):
    """Quest-style page selection: read the top ``num_pages`` pages (plus the steady zone)
    exactly, ranked by ``sum_d max(q_d * min_d, q_d * max_d)``; GQA groups share pages,
    ranked by the group's summed softmax of those bounds, as in the wave index."""

    def __init__(self, config: RetroConfig, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, store: ClusterStore | None = None,
                 page_size: int = 16):
        if page_size < 1:
            raise ValueError(f"page_size={page_size}; accepted: a positive integer")
        super().__init__(config, num_kv_heads, head_dim, dtype, device, store)
        self.page_size = page_size
        self.num_pages = 0  # pages read exactly per decode step (token budget / page size)
        self.page_min = torch.empty(num_kv_heads, 0, head_dim, device=device)
        self.page_max = torch.empty_like(self.page_min)

    def _cluster(self, keys: torch.Tensor, values: torch.Tensor, update: bool) -> Clusters:
        return page_clusters(keys, values, self.page_size)

    def _add_block(self, keys: torch.Tensor, values: torch.Tensor, start: int,
                   clusters: Clusters) -> None:
        super()._add_block(keys, values, start, clusters)
        h, m, d = keys.shape
        ps = self.page_size
        p = math.ceil(m / ps)
        kf = keys.float()
        last = kf[:, -1:].expand(h, p * ps - m, d)  # pad with a real key: bounds unchanged
        kp = torch.cat([kf, last], dim=1).reshape(h, p, ps, d)
        self.page_min = torch.cat([self.page_min, kp.amin(2)], dim=1)
        self.page_max = torch.cat([self.page_max, kp.amax(2)], dim=1)

    def select(self, query: torch.Tensor, scale: float) -> Selection:
        h = self.num_kv_heads
        q = query.reshape(h, -1, self.head_dim).float()  # [H, G, D]
        if self.num_clusters == 0 or self.num_pages <= 0:
            none = torch.empty(h, 0, dtype=torch.int64, device=query.device)
            return Selection(none, none)
        bound = torch.maximum(q[:, :, None, :] * self.page_min[:, None],
                              q[:, :, None, :] * self.page_max[:, None]).sum(-1) * scale
        scores = group_scores_from_logits(bound, self.sizes > 0)
        k = min(self.num_pages, self.num_clusters)
        top = torch.topk(scores, k, dim=1).indices
        return Selection(top, top[:, :0])


def quest_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_budget: int,
    config: RetroConfig | None = None,
    scale: float | None = None,
    page_size: int = 16,
) -> tuple[torch.Tensor, dict]:
    """Quest-style baseline with the same steady zone as the wave index plus
    ``round(token_budget / page_size)`` pages read exactly. Shapes as
    :func:`vllm_retro.index.sparse_attention`; ``token_budget`` counts retrieved tokens
    (steady zone excluded)."""
    validate_qkv(query, keys, values)
    config = (config or RetroConfig()).replace(estimation_budget=0.0)
    index = QuestIndex.build(keys, values, config, page_size=page_size)
    index.num_pages = max(0, round(token_budget / page_size))
    res = index.decode(query, scale)
    return res.output, index.zone_stats(res.selection, res.n_exact)
