"""Where the indexed KV lives: the interface the wave index reads clusters through.

The wave index decides *which* clusters to read; a :class:`ClusterStore` decides *where the
bytes come from*. :class:`DenseClusterStore` keeps the cluster-contiguous KV in one tensor
pair on the index's own device; the wave buffer implements the same interface over a host
tier and a device block cache.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from vllm_retro.index.clustering import Clusters


@runtime_checkable
class ClusterStore(Protocol):
    """Storage of the indexed tokens' KV, addressed by (KV head, cluster id)."""

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               clusters: Clusters) -> None:
        """Add a clustered block: keys/values [H, M, D] in token order, positions [M] int64
        absolute token positions, ``clusters`` its clustering (ids continue after the
        clusters already stored)."""
        ...

    def gather(self, cluster_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:
        """Read whole clusters. cluster_ids: [H, R] int64 (any order, no repeats per head).

        Returns (keys [H, T, D], values [H, T, D], positions [H, T] int64, lengths [H]):
        per head the member tokens of its clusters, packed at the front, padding after
        ``lengths[h]`` (positions -1 there).
        """
        ...

    def nbytes(self) -> int:
        """Bytes of KV held."""
        ...


class DenseClusterStore:
    """All indexed KV in one cluster-contiguous tensor pair per request-layer (no tiers)."""

    def __init__(self, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.empty(num_heads, 0, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.positions = torch.empty(num_heads, 0, dtype=torch.int64, device=device)
        self.offsets = torch.zeros(num_heads, 1, dtype=torch.int64, device=device)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               clusters: Clusters) -> None:
        """See :meth:`ClusterStore.append`."""
        idx = clusters.order[..., None].expand(-1, -1, keys.shape[2])
        base = self.keys.shape[1]
        self.keys = torch.cat([self.keys, torch.gather(keys, 1, idx)], dim=1)
        self.values = torch.cat([self.values, torch.gather(values, 1, idx)], dim=1)
        self.positions = torch.cat([self.positions, positions[clusters.order]], dim=1)
        self.offsets = torch.cat([self.offsets, clusters.offsets[:, 1:] + base], dim=1)

    def gather(self, cluster_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:
        """See :meth:`ClusterStore.gather`."""
        token_idx, lengths = cluster_token_index(self.offsets, cluster_ids)
        safe = token_idx.clamp_min(0)
        d = self.keys.shape[2]
        k = torch.gather(self.keys, 1, safe[..., None].expand(-1, -1, d))
        v = torch.gather(self.values, 1, safe[..., None].expand(-1, -1, d))
        pos = torch.where(token_idx >= 0, torch.gather(self.positions, 1, safe), -1)
        return k, v, pos, lengths

    def nbytes(self) -> int:
        """See :meth:`ClusterStore.nbytes`."""
        return self.keys.numel() * self.keys.element_size() * 2


def cluster_token_index(
    offsets: torch.Tensor, cluster_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand cluster ids into the indices of their tokens in a cluster-contiguous layout.

    offsets: [H, C + 1] run starts; cluster_ids: [H, R]. Returns (index [H, T] int64 into
    the layout, -1 as padding, T = the largest per-head total; lengths [H] int64).
    """
    h = offsets.shape[0]
    ids = cluster_ids.long()
    starts = torch.gather(offsets, 1, ids)
    lens = torch.gather(offsets, 1, ids + 1) - starts  # [H, R]
    ends = lens.cumsum(1)
    lengths = ends[:, -1] if ids.shape[1] else torch.zeros(h, dtype=torch.int64,
                                                           device=offsets.device)
    t = int(lengths.max().item()) if h else 0
    slot = torch.arange(t, device=offsets.device)[None, :].expand(h, t).contiguous()
    which = torch.searchsorted(ends, slot, right=True).clamp_max(max(ids.shape[1] - 1, 0))
    begin = ends - lens
    idx = torch.gather(starts, 1, which) + slot - torch.gather(begin, 1, which)
    idx = torch.where(slot < lengths[:, None], idx, torch.full_like(idx, -1))
    return idx, lengths
