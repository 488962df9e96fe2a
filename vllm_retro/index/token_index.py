"""What the token-level policies share (PQCache, RetrievalAttention's graph index): indexes
whose decode steps read single indexed tokens rather than whole clusters.

Their KV is cut into blocks of ``block_tokens`` consecutive positions, each a 'cluster' of
the store (:func:`position_blocks`), so the wave buffer caches whole blocks (PQCache's
block-level cache) while a step reads chosen tokens one by one
(``store.gather_tokens_into``). Per indexed token the index keeps the block it is in and
its place there (:attr:`TokenIndex.token_cluster`, :attr:`TokenIndex.token_offset`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.clustering import Clusters
from vllm_retro.index.store import ClusterStore
from vllm_retro.index.wave_index import WaveIndex


def position_blocks(keys: torch.Tensor, block: int, short_first: bool = False) -> Clusters:
    """Cut a block of tokens ([H, M, D] keys) into runs of ``block`` consecutive positions
    (the last one shorter; the first with ``short_first``, so the newest runs are whole),
    each a 'cluster' in token order, identical across heads. Only the layout fields are
    filled (no centroids or moments: these policies estimate nothing)."""
    h, m, d = keys.shape
    dev = keys.device
    c = math.ceil(m / block)
    sizes = torch.full((h, c), block, dtype=torch.int32, device=dev)
    sizes[:, 0 if short_first else -1] = m - (c - 1) * block
    offsets = torch.zeros(h, c + 1, dtype=torch.int64, device=dev)
    offsets[:, 1:] = sizes.long().cumsum(1)
    empty = keys.new_empty(h, 0, d)
    f32 = torch.zeros(h, 0, device=dev)
    return Clusters(centroids=empty, value_sums=empty, sizes=sizes, spreads=f32,
                    key_sq=torch.zeros(h, d, device=dev), cross=torch.zeros(h, d, d, device=dev),
                    order=torch.arange(m, device=dev)[None].expand(h, m).contiguous(),
                    offsets=offsets)


class TokenIndex(WaveIndex):
    """A wave index read token by token (see the module docstring); subclasses choose the
    tokens. ``block_tokens``: positions per block of the store."""

    clusters_in_rounds = False
    selects_zones = False
    kernel_scores = False
    lands_in_store = False
    meta_kept = ("sizes",)

    def __init__(self, config: RetroConfig, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, store: ClusterStore | None,
                 block_tokens: int):
        super().__init__(config, num_kv_heads, head_dim, dtype, device, store)
        self.block_tokens = block_tokens
        self.token_cluster = np.zeros(0, dtype=np.int64)
        """[N] the block ('cluster' of the store) each indexed token is in."""
        self.token_offset = np.zeros(0, dtype=np.int64)
        """[N] each indexed token's place within its block."""
        self.fixed_budget: int | None = None
        """Tokens read per KV head at each step, set for matched-budget comparisons
        (:meth:`set_token_budget`); None: the policy's own budget."""

    @property
    def num_indexed(self) -> int:
        """Indexed tokens per KV head (positions ``sinks`` .. ``window_start``)."""
        return int(self.token_cluster.shape[0])

    def set_token_budget(self, tokens: int) -> None:
        """Read ``tokens`` indexed tokens per KV head at each step instead of the policy's
        own budget (the attention-level comparison's matched budgets)."""
        self.fixed_budget = max(0, int(tokens))
        self.fused_view = None

    def _cluster(self, keys: torch.Tensor, values: torch.Tensor, update: bool) -> Clusters:
        return position_blocks(keys, self.block_tokens)

    def _add_meta(self, clusters: Clusters) -> None:
        # only the block sizes: no centroids, value sums or residual model to keep
        self.fused_view = None
        self.meta_generation += 1
        self.meta_rows.append({"sizes": clusters.sizes}, 4)

    def _add_block(self, keys: torch.Tensor, values: torch.Tensor, start: int,
                   clusters: Clusters) -> None:
        first = self.num_clusters
        super()._add_block(keys, values, start, clusters)
        sizes = clusters.sizes[0].cpu().numpy().astype(np.int64)
        starts = np.cumsum(sizes) - sizes
        which = np.repeat(np.arange(sizes.size), sizes)
        self.token_cluster = np.concatenate([self.token_cluster, first + which])
        self.token_offset = np.concatenate(
            [self.token_offset, np.arange(int(sizes.sum())) - starts[which]])

    def free(self) -> None:
        """Release the store's KV and the token tables (the index is unusable after)."""
        super().free()
        self.token_cluster = self.token_cluster[:0]
        self.token_offset = self.token_offset[:0]
