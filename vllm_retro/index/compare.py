"""The attention-level comparison of the wave index with every baseline at one budget.

Each decode step, every baseline reads exactly the same steady zone as the wave index plus as
many indexed tokens as the wave index's retrieval zone held at that step (mean over KV
heads; Quest rounds to whole pages) — the budget rule of :mod:`vllm_retro.index.baselines`.
"""

from __future__ import annotations

import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.baselines import BASELINES
from vllm_retro.index.evaluate import AttentionAccuracy, Step, compare_policies, evaluate_policy
from vllm_retro.index.graph_index import GraphIndex
from vllm_retro.index.saap import SaapIndex
from vllm_retro.index.saap_model import SaapModel
from vllm_retro.index.wave_index import DecodeResult, WaveIndex

TOKEN_BASELINES = ("pqcache", "streaming", "oracle")  # streaming reads pages: same budget rule
"""The baselines run here on top of :func:`compare_policies` (which runs Quest)."""


def matched_budget_step(budget: torch.Tensor) -> Step:
    """A decode step reading ``round(budget[i])`` indexed tokens at step ``i``.

    budget: [n_queries] tokens per KV head beyond the steady zone (e.g. the wave index's
    :attr:`AttentionAccuracy.retrieved_tokens`).
    """

    def step(index: WaveIndex, query: torch.Tensor, scale: float, i: int) -> DecodeResult:
        index.set_token_budget(round(float(budget[i])))  # type: ignore[attr-defined]
        return index.decode(query, scale, return_positions=True)

    return step


def compare_all(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    config: RetroConfig | None = None,
    top_k: int = 100,
    pq_options: dict | None = None,
    graph_queries: torch.Tensor | None = None,
    saap_model: SaapModel | None = None,
    layer: int = 0,
) -> dict[str, AttentionAccuracy]:
    """Every policy on one layer: ``wave``, ``wave_no_estimation``, ``quest`` (see
    :func:`compare_policies`), then ``pqcache``, ``streaming``, ``oracle`` and ``graph`` at
    the wave index's per-step retrieved-token count.

    queries: [Hq, n_queries, D] at ``positions`` [n_queries] (consecutive, ascending);
    keys, values: [Hkv, N, D]. ``pq_options`` go to :class:`~vllm_retro.index.pq_index.PQIndex`
    (``subspaces``, ``bits``, ``iters``). ``graph``: RetrievalAttention's graph index
    (:class:`~vllm_retro.index.graph_index.GraphIndex`) at the same budget, trained on
    ``graph_queries`` ([Hq, T, D] prefill queries before ``positions``; None: the keys).
    ``saap``, when ``saap_model`` (a trained SAAP file's routing, of decoder ``layer``) is
    given: SAAP visiting, per step, the bucket count closest to the same budget.
    """
    cfg = (config or RetroConfig()).replace(estimation_budget=0.0)
    out = compare_policies(queries, keys, values, positions, scale, config, top_k)
    step = matched_budget_step(out["wave"].retrieved_tokens)
    for name in TOKEN_BASELINES:
        opts = (pq_options or {}) if name == "pqcache" else {}
        cls = BASELINES[name]
        out[name] = evaluate_policy(lambda k, v, cls=cls, opts=opts: cls.build(k, v, cfg, **opts),
                                    queries, keys, values, positions, scale, top_k, step=step)
    graph_cfg = cfg.replace(index="graph")
    out["graph"] = evaluate_policy(
        lambda k, v: GraphIndex.build(k, v, graph_cfg, queries=graph_queries),
        queries, keys, values, positions, scale, top_k, step=step)
    if saap_model is not None:
        out["saap"] = evaluate_policy(
            lambda k, v: SaapIndex.build(k, v, cfg, model=saap_model, layer=layer),
            queries, keys, values, positions, scale, top_k, step=step)
    return out
