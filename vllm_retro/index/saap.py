"""SAAP as a serving index (Mazaré et al., 2025; ``../shared/seeds/003``).

SAAP's buckets are the wave index's clusters. At prefill the indexed keys (between the
sinks and the local window) of every KV head are de-RoPEd at their positions and assigned
to the nearest of the layer/head's ``C`` trained centroids (:class:`SaapLayer.assign`):
that assignment is the whole index build, no clustering. They are stored cluster-contiguous
as ``C`` clusters (bucket ``b`` is cluster ``b``; empty buckets have size 0). Each decode
update block (the oldest ``update_segment`` tokens of the local window) is assigned the same
way and appended as ``C`` more clusters, so bucket ``b`` of block ``k`` is cluster
``k * C + b``.

At each decode step the newest token's queries (the GQA group of each KV head) are
de-RoPEd at their position and ranked through the trained classifier: the ``saap_probes``
(``l``) buckets with the largest ``sum_g softmax(f_q(q_g))`` are visited, i.e. every cluster
of those buckets in every block is read exactly (the retrieval zone), with the steady zone
(sinks + local window). There is no estimation zone. ``l = C`` reads every indexed token:
full attention. Layers the file marks dense (the paper's layer 0) always visit every bucket.

The KV is in the index's store (the wave buffer in serving); decoding goes row by row
through :meth:`WaveIndex.decode` (selection here, gather and exact attention shared).
"""

from __future__ import annotations

import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.clustering import Clusters
from vllm_retro.index.pq_index import top_tokens
from vllm_retro.index.saap_model import SaapModel, layer_number, load_saap
from vllm_retro.index.store import ClusterStore
from vllm_retro.index.wave_index import Selection, WaveIndex


def bucket_clusters(buckets: torch.Tensor, num_buckets: int) -> Clusters:
    """A block's bucket assignment as clusters: cluster ``b`` holds the tokens of bucket
    ``b`` (size 0 when none), cluster-contiguous in token order within a bucket. Only the
    layout fields are filled (SAAP keeps no centroids or moments per cluster).

    buckets: [H, M] int64 in [0, C)."""
    h, m = buckets.shape
    dev = buckets.device
    sizes = torch.zeros(h, num_buckets, dtype=torch.int64, device=dev)
    sizes.scatter_add_(1, buckets, torch.ones_like(buckets))
    offsets = torch.zeros(h, num_buckets + 1, dtype=torch.int64, device=dev)
    offsets[:, 1:] = sizes.cumsum(1)
    empty = torch.zeros(h, 0, 0, device=dev)
    return Clusters(centroids=empty, value_sums=empty, sizes=sizes.to(torch.int32),
                    spreads=torch.zeros(h, 0, device=dev), key_sq=torch.zeros(h, 0, device=dev),
                    cross=torch.zeros(h, 0, 0, device=dev),
                    order=torch.argsort(buckets, dim=1, stable=True), offsets=offsets)


def saap_selection(indexes: list[SaapIndex], query: torch.Tensor
                   ) -> tuple[torch.Tensor, list[int]]:
    """The retrieval clusters of ``indexes[b]`` (one layer) for ``query[b]`` ([B, Hq, D]),
    the batch's buckets ranked by one classifier pass: each index's top ``l`` buckets in
    every one of its blocks, block by block, as :meth:`SaapIndex.select` gives one request.
    Returns (ids [B, H, W] int64 on the query's device, row b's first ``counts[b]`` valid
    and the rest -1; counts)."""
    first = indexes[0]
    b, h, c, dev = len(indexes), first.num_kv_heads, first.num_buckets, query.device
    probes = min(first.probes, c)
    if probes == c:
        top = torch.arange(c, device=dev)[None, None].expand(b, h, c)
    else:
        pos = torch.tensor([i.num_tokens - 1 for i in indexes], device=dev)
        scores = first.routing.bucket_scores_batch(query.reshape(b, h, -1, first.head_dim),
                                                   pos)
        budgets = torch.full((b * h,), probes, dtype=torch.int64, device=dev)
        top = top_tokens(scores.reshape(b * h, c), budgets).reshape(b, h, probes)
    blocks = [i.num_blocks for i in indexes]
    most = max(blocks)
    start = torch.arange(most, device=dev) * c  # [blocks]: each block's first cluster
    ids = (start[None, None, :, None] + top[:, :, None, :]).reshape(b, h, most * probes)
    counts = [n * probes for n in blocks]
    if min(blocks) < most:  # rows with fewer blocks: their tail is padding
        valid = torch.arange(most * probes, device=dev)[None, :] < torch.tensor(
            counts, device=dev)[:, None]
        ids = ids.masked_fill(~valid[:, None, :], -1)
    return ids, counts


class SaapIndex(WaveIndex):
    """The SAAP index of one (request, layer); see the module docstring. Built, appended to
    and decoded like :class:`WaveIndex`.

    ``model``: the trained routing (default: ``config.saap.file``, loaded once per process);
    ``layer``: the decoder layer index, or a vLLM attention layer name holding it.
    """

    clusters_in_rounds = False
    selects_zones = False
    kernel_scores = False
    meta_kept = ("sizes",)

    @staticmethod
    def select_batch(indexes: list[SaapIndex], query: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, list[int]]:
        """See :attr:`WaveIndex.select_batch`: :func:`saap_selection`."""
        return saap_selection(indexes, query)

    def __init__(self, config: RetroConfig, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, store: ClusterStore | None = None,
                 model: SaapModel | None = None, layer: int | str = 0):
        super().__init__(config, num_kv_heads, head_dim, dtype, device, store)
        if model is None:
            if config.saap.file is None:
                raise ValueError("SaapIndex needs a SAAP model: pass model= or set "
                                 "config.saap.file")
            model = load_saap(config.saap.file)
        model.check_serving(num_kv_heads, head_dim, config.saap.probes)
        self.model = model
        """The trained routing (shared by every index of the process)."""
        self.layer = layer_number(layer)
        """The decoder layer this index serves."""
        self.routing = model.layer(self.layer, device)
        self.num_buckets = model.num_buckets
        """C: clusters per block."""
        self.probes = self.num_buckets if self.routing.dense else config.saap.probes
        """l: buckets visited per decode query (all of them in a dense layer)."""
        self.token_budget: int | None = None
        """Indexed tokens to read per KV head and step instead (:meth:`set_token_budget`)."""

    @property
    def num_blocks(self) -> int:
        """Blocks indexed so far (the prefill's, then one per update block)."""
        return self.num_clusters // self.num_buckets

    def _cluster(self, keys: torch.Tensor, values: torch.Tensor, update: bool) -> Clusters:
        # the block starts at the window's start: the prefill's middle (window_start is then
        # the sink count) or the window's oldest update_segment tokens
        pos = torch.arange(self.window_start, self.window_start + keys.shape[1],
                           device=keys.device)
        return bucket_clusters(self.routing.assign(keys, pos, self.backend), self.num_buckets)

    def _add_meta(self, clusters: Clusters) -> None:
        # only the cluster sizes: no centroids, value sums or residual model to keep
        self.fused_view = None
        self.meta_generation += 1
        self.meta_rows.append({"sizes": clusters.sizes}, self.num_buckets)

    def meta_nbytes(self) -> int:
        """Bytes of the per-cluster sizes (with room for a later block); the trained routing
        is the process's, shared by every request, like the model's weights."""
        return self._own_meta_nbytes()

    def bucket_scores(self, query: torch.Tensor) -> torch.Tensor:
        """The classifier's ranking of the buckets for the newest token's query
        [num_heads, D] (at position ``num_tokens - 1``: its key is appended before it
        decodes, as the engine does). Returns [H, C] fp32."""
        q = query.reshape(self.num_kv_heads, -1, self.head_dim)
        return self.routing.bucket_scores(q, self.num_tokens - 1)

    def select(self, query: torch.Tensor, scale: float) -> Selection:
        """The clusters read exactly for a query [num_heads, D]: retrieval ids [H, l x blocks]
        (the top ``l`` buckets by :meth:`bucket_scores`, ties to the lower bucket, each in
        every block, block by block), no estimation."""
        if self.num_clusters == 0:
            none = torch.empty(self.num_kv_heads, 0, dtype=torch.int64, device=query.device)
            return Selection(none, none)
        if self.token_budget is not None and not self.routing.dense:
            self.probes = self._probes_for(self.bucket_scores(query), self.token_budget)
        ids, _ = saap_selection([self], query[None])
        return Selection(ids[0], ids[0, :, :0])

    def set_token_budget(self, tokens: int | None) -> None:
        """Visit, at each step, as many buckets (the same number for every KV head) as make
        the indexed tokens read per KV head, on average over the heads, closest to
        ``tokens`` (at least one bucket), instead of ``saap_probes`` (the attention-level
        comparison's matched budgets; SAAP reads whole buckets). None: back to
        ``saap_probes``."""
        self.token_budget = None if tokens is None else max(0, int(tokens))
        if tokens is None:
            self.probes = self.num_buckets if self.routing.dense else self.config.saap.probes

    def _probes_for(self, scores: torch.Tensor, tokens: int) -> int:
        """The bucket count whose top buckets by ``scores`` ([H, C]) hold, on average over
        the heads, the number of indexed tokens closest to ``tokens``."""
        h, c = scores.shape
        per_bucket = self.sizes.reshape(h, -1, c).sum(1).float()  # [H, C] over the blocks
        order = torch.sort(-scores, dim=1, stable=True).indices
        held = per_bucket.gather(1, order).cumsum(1).mean(0)  # [C]: top l + 1 buckets
        return int((held - tokens).abs().argmin()) + 1
