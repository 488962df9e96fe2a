"""Page-level policies as serving indexes: Quest and StreamingLLM.

Both cut the indexed KV into pages of ``quest_page_size`` consecutive positions, each a
cluster of the store (:func:`~vllm_retro.index.token_index.position_blocks`; a block's
first page is the short one, so the pages next to the window are whole), and read whole
pages exactly, with the steady zone (sinks + local window); neither estimates anything.
They differ only in which pages a decode step reads:

- :class:`QuestIndex` (Tang et al., 2024): per page the element-wise min and max of its
  keys (kept per KV head, in the keys' dtype: 2 rows per page, 1/8 of the KV at 16-token
  pages); a query head's upper bound of ``q . k`` over a page is
  ``sum_d max(q_d * min_d, q_d * max_d)``. A KV head's GQA group shares its pages, ranked
  by the group's summed softmax of those bounds (as the wave index ranks clusters), and the
  top ``ceil(quest_token_budget / quest_page_size)`` are read.
- :class:`StreamingIndex` (StreamingLLM, Xiao et al., 2024): the most recent pages, so a
  step attends the sinks and a recent window widened by ``streaming_tokens``; the query
  plays no part. The older KV stays in the host tier (never read).

A page count at least the number of pages reads every indexed token: full attention.

Batched decode (:func:`~vllm_retro.index.batched.decode_batch`): on the CPU, Quest's rows
go through the fused kernel as the wave index's do, which scores each row's page bounds in
place (:meth:`QuestIndex.fused_scoring`) and reads the top pages, one call per layer.
StreamingLLM's pages, and Quest's off the fused path, are chosen row by row
(:func:`page_selection`), then every row of the layer is read in one call with the chosen
clusters given, as SAAP's buckets are.
"""

from __future__ import annotations

import math

import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.clustering import Clusters
from vllm_retro.index.meta_pool import FieldSpec
from vllm_retro.index.store import ClusterStore
from vllm_retro.index.token_index import position_blocks
from vllm_retro.index.wave_index import Selection, WaveIndex
from vllm_retro.kernels.scoring import page_bound_scores_ref


class PageIndex(WaveIndex):
    """Pages of ``quest_page_size`` positions as the store's clusters; a subclass ranks them
    (:meth:`page_scores`) and the top :attr:`num_pages` are read exactly."""

    clusters_in_rounds = False
    selects_zones = False
    kernel_scores = False
    meta_kept = ("sizes",)

    @staticmethod
    def select_batch(indexes: list[PageIndex], query: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, list[int]]:
        """See :attr:`WaveIndex.select_batch`: :func:`page_selection`."""
        return page_selection(indexes, query, scale)

    def __init__(self, config: RetroConfig, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, store: ClusterStore | None = None):
        super().__init__(config, num_kv_heads, head_dim, dtype, device, store)
        self.page_size = config.pages.page_tokens
        self.num_pages = math.ceil(self.default_budget(config) / self.page_size)
        """Pages read exactly per decode step and KV head."""

    @staticmethod
    def default_budget(config: RetroConfig) -> int:
        """Indexed tokens read per step by default (rounded up to whole pages)."""
        raise NotImplementedError

    def set_token_budget(self, tokens: int) -> None:
        """Read ``round(tokens / page_size)`` pages per step instead of the default (the
        attention-level comparison's matched budgets)."""
        self.num_pages = max(0, round(int(tokens) / self.page_size))
        self.fused_view = None  # the fused kernel's packed budget

    def _cluster(self, keys: torch.Tensor, values: torch.Tensor, update: bool) -> Clusters:
        return position_blocks(keys, self.page_size, short_first=True)

    def _add_meta(self, clusters: Clusters) -> None:
        # only the page sizes: no centroids, value sums or residual model to keep
        self.fused_view = None
        self.meta_generation += 1
        self.meta_rows.append({"sizes": clusters.sizes}, 4 * self._block_pages)

    @property
    def _block_pages(self) -> int:
        return math.ceil(self.config.update_segment / self.page_size)

    def meta_nbytes(self) -> int:
        """Bytes of the per-page rows (with room for later blocks)."""
        return self._own_meta_nbytes()

    def page_scores(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Rank of every page for a query [num_heads, D]: [H, P] (higher is read first)."""
        raise NotImplementedError

    def zone_sizes(self, clusters: int) -> tuple[int, int]:
        """The top :attr:`num_pages` pages (at most all), nothing estimated."""
        return min(self.num_pages, clusters), 0

    def select(self, query: torch.Tensor, scale: float) -> Selection:
        """The pages read exactly for a query [num_heads, D]: the top :attr:`num_pages` by
        :meth:`page_scores` ([H, k] ids, highest first), no estimation."""
        k = self.zone_sizes(self.num_clusters)[0]
        if k <= 0:
            none = torch.empty(self.num_kv_heads, 0, dtype=torch.int64, device=query.device)
            return Selection(none, none)
        top = torch.topk(self.page_scores(query, scale), k, dim=1).indices
        return Selection(top, top[:, :0])


class QuestIndex(PageIndex):
    """Quest: pages ranked by the upper bound of ``q . k`` from their keys' per-dimension
    min and max; see the module docstring."""

    kernel_scores = True
    scoring_field = "page_bounds"
    lands_in_store = False

    @staticmethod
    def default_budget(config: RetroConfig) -> int:
        return config.pages.quest_tokens

    def meta_fields(self, dtype: torch.dtype) -> dict[str, FieldSpec]:
        return super().meta_fields(dtype) | {"page_bounds": ((2 * self.head_dim,), dtype)}

    @property
    def page_bounds(self) -> torch.Tensor:
        """[H, P, 2D] each page's per-dimension max of its keys, then min (keys' dtype)."""
        return self.meta_rows.view("page_bounds")

    @property
    def page_max(self) -> torch.Tensor:
        """[H, P, D] each page's element-wise max of its keys."""
        return self.page_bounds[..., :self.head_dim]

    @property
    def page_min(self) -> torch.Tensor:
        """[H, P, D] each page's element-wise min of its keys."""
        return self.page_bounds[..., self.head_dim:]

    def _add_block(self, keys: torch.Tensor, values: torch.Tensor, start: int,
                   clusters: Clusters) -> None:
        super()._add_block(keys, values, start, clusters)
        h, m, d = keys.shape
        p = math.ceil(m / self.page_size)
        first = keys[:, :1].expand(h, p * self.page_size - m, d)  # a real key: bounds kept
        pages = torch.cat([first, keys], dim=1).reshape(h, p, self.page_size, d)
        bounds = torch.cat([pages.amax(2), pages.amin(2)], dim=2)
        self.meta_rows.append({"page_bounds": bounds}, 4 * self._block_pages)

    def fused_scoring(self) -> tuple[torch.Tensor, int, int]:
        """The page bounds [H, P, 2D], which the fused CPU kernel and the device step score
        as :meth:`page_scores` does (the query split into its positive and negative
        parts); the top :attr:`num_pages` read, nothing estimated."""
        return self.page_bounds, *self.zone_sizes(self.num_clusters)

    def page_scores(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The GQA group's summed softmax of each query head's page bounds
        ``scale * sum_d max(q_d * min_d, q_d * max_d)``: [H, P] fp32 (log)."""
        q = query.reshape(self.num_kv_heads, -1, self.head_dim)  # [H, G, D]
        return page_bound_scores_ref(q, self.page_bounds, self.sizes, scale)


class StreamingIndex(PageIndex):
    """StreamingLLM: the most recent pages; see the module docstring."""

    @staticmethod
    def default_budget(config: RetroConfig) -> int:
        return config.pages.streaming_tokens

    def page_scores(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The page's position: [H, P] fp32 (the newest page highest)."""
        p = self.num_clusters
        return torch.arange(p, device=query.device, dtype=torch.float32)[None].expand(
            self.num_kv_heads, p)


def page_selection(indexes: list[PageIndex], query: torch.Tensor, scale: float
                   ) -> tuple[torch.Tensor, list[int]]:
    """The pages each of ``indexes`` (one layer) reads for ``query[b]`` ([B, Hq, D]):
    (ids [B, H, W] int64 on the query's device, row b's first ``counts[b]`` valid and the
    rest -1; counts), as :meth:`PageIndex.select` gives each row."""
    picks = [i.select(query[b], scale).retrieval_ids for b, i in enumerate(indexes)]
    counts = [int(p.shape[1]) for p in picks]
    width = max(counts)
    ids = torch.full((len(indexes), indexes[0].num_kv_heads, width), -1, dtype=torch.int64,
                     device=query.device)
    for b, p in enumerate(picks):
        ids[b, :, :counts[b]] = p
    return ids, counts


PAGE_INDEXES: dict[str, type[PageIndex]] = {"quest": QuestIndex, "streaming": StreamingIndex}
"""The page policies by their ``RetroConfig.index`` name."""
