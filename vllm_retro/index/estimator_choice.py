"""The estimator of each KV head under ``estimator='auto'``, judged when the index is built.

The tilted estimator (:mod:`vllm_retro.index.estimator`) is closer to exact attention than
the paper's centroid weight on most heads, not on all: on a layer whose attention is broad
and whose clusters are wide it can overshoot the estimated clusters' mass (Qwen2.5's first
layer, inside a served engine: mean relative error 0.46 against the centroid's 0.19 and
no estimation at all's 0.20; ``bench/results/layer_error_4k.json``). Which heads those are
is a property of the model and the prompt, so the index asks the prompt: for each of its
last queries (post-RoPE, ``[Hq, T, D]``; they attend over nearly the whole prompt, as the
first decode steps will), the zones are selected as decoding selects them
(:meth:`~vllm_retro.index.wave_index.WaveIndex.select`) and attention over the indexed
tokens is computed three ways: exactly, and with the estimation zone weighted by each
estimator (the retrieval zone read exactly in both). A head keeps the tilted estimator
unless the centroid's relative error, averaged over the head's query heads and the
queries, is lower. The steady zone (sinks, window) is left out: it is exact under both.

Cost: per query two plain-torch tripartite decodes and one dense attention over the
indexed tokens, on the build's thread: the build takes 2.4x as long at 4K tokens and 1.6x at
32K (73 and 216 ms more, 2 KV heads of 64, a 2-core CPU); decode steps cost nothing more.
"""

from __future__ import annotations

import torch

from vllm_retro.index.clustering import Clusters
from vllm_retro.kernels.tripartite_attention import TiltTerms, tripartite_decode_ref

JUDGE_QUERIES = 16
"""The prompt's last queries the choice is judged on."""


def token_clusters(clusters: Clusters) -> torch.Tensor:
    """[H, N] int64 cluster (block-local id) of each token of the clustered block, from its
    cluster-contiguous layout (``order``, ``offsets``); -1 for a token in no cluster."""
    h, m = clusters.order.shape
    rank = torch.arange(m, device=clusters.order.device).expand(h, m).contiguous()
    cid = torch.searchsorted(clusters.offsets[:, 1:].contiguous(), rank, right=True)
    labels = torch.full((h, m), -1, dtype=torch.int64, device=clusters.order.device)
    return labels.scatter_(1, clusters.order, cid)


def estimator_errors(index, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     labels: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean relative error ``|out - exact| / |exact|`` per KV head of attention over the
    indexed tokens, (tilted, centroid): fp32 [H] each.

    index: a built :class:`~vllm_retro.index.wave_index.WaveIndex` whose residual model
    still tilts every head; queries [Hq, T, D]; keys, values [H, N, D]: the indexed tokens
    as clustered (block order), labels [H, N] their clusters (:func:`token_clusters`)."""
    h, n, d = keys.shape
    group = queries.shape[0] // h
    kf, vf = keys.float(), values.float()
    valid = labels >= 0
    err_tilted = torch.zeros(h, dtype=torch.float32, device=keys.device)
    err_centroid = torch.zeros_like(err_tilted)
    steps = queries.shape[1]
    for t in range(steps):
        q = queries[:, t].reshape(h, group, d)
        sel = index.select(q.reshape(h * group, d), scale)
        logits = torch.bmm(q.float(), kf.transpose(1, 2)) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        exact = torch.bmm(torch.softmax(logits, dim=-1), vf)  # [H, G, D]
        chosen = torch.zeros(h, index.num_clusters, dtype=torch.bool, device=keys.device)
        chosen.scatter_(1, sel.retrieval_ids, True)
        read = chosen.gather(1, labels.clamp_min(0)) & valid  # [H, N] tokens read exactly
        n_exact = read.sum(1)
        first = torch.argsort((~read).to(torch.int8), dim=1, stable=True)
        width = max(int(n_exact.max()), 1)
        rows = first[:, :width, None].expand(-1, -1, d)
        k_exact, v_exact = kf.gather(1, rows), vf.gather(1, rows)
        n_est = torch.full((h,), sel.estimation_ids.shape[1], dtype=torch.int64,
                           device=keys.device)
        qvar, vshift = index.residuals.query_terms(q, scale)
        tilt = TiltTerms(index.spreads, index.deviates, qvar, vshift)
        norm = exact.norm(dim=-1).clamp_min(1e-30)
        for err, terms in ((err_tilted, tilt), (err_centroid, None)):
            out, _ = tripartite_decode_ref(
                q.float(), k_exact, v_exact, n_exact, index.centroids, index.value_sums,
                index.sizes, sel.estimation_ids, n_est, scale, terms)
            err += ((out.float() - exact).norm(dim=-1) / norm).mean(1)
    return err_tilted / max(steps, 1), err_centroid / max(steps, 1)


def choose_tilted_heads(index, queries: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor, clusters: Clusters, scale: float
                        ) -> torch.Tensor:
    """[H] bool: the KV heads that keep the tilted estimator (see the module docstring);
    the last :data:`JUDGE_QUERIES` of ``queries`` [Hq, T, D] judge."""
    queries = queries[:, -JUDGE_QUERIES:]
    err_tilted, err_centroid = estimator_errors(index, queries, keys, values,
                                                token_clusters(clusters), scale)
    return err_tilted <= err_centroid
