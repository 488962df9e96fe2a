"""Attention-level accuracy of a selection policy on captured Q/K/V.

The context's first ``positions[0]`` tokens are prefilled into an index, then each captured
query is decoded in order, its own token appended first — exactly as a serving engine would
run it — and compared with exact causal attention: relative L2 error of each head's output
and recall of the true top-k keys among the tokens read exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.pages import QuestIndex
from vllm_retro.index.wave_index import DecodeResult, WaveIndex

Step = Callable[[WaveIndex, torch.Tensor, float, int], DecodeResult]


@dataclass(frozen=True)
class AttentionAccuracy:
    """Per-(query, head) metrics of one policy on one layer."""

    rel_err: torch.Tensor
    """[n_queries, num_heads] ||out - exact|| / ||exact|| per head (fp64)."""
    recall: torch.Tensor
    """[n_queries, num_heads] fraction of the true top-k keys read exactly."""
    retrieved_tokens: torch.Tensor
    """[n_queries] mean tokens per KV head read exactly beyond the steady zone."""

    def summary(self) -> dict[str, float]:
        """Mean and 90th percentile of the error, mean recall, mean retrieved tokens."""
        return {
            "rel_err_mean": float(self.rel_err.mean()),
            "rel_err_p90": float(self.rel_err.flatten().quantile(0.9)),
            "recall_mean": float(self.recall.mean()),
            "retrieved_tokens": float(self.retrieved_tokens.mean()),
        }


def exact_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of query [Hq, D] over keys/values [Hkv, N, D] in fp64.

    Returns (output [Hq, D], probabilities [Hq, N]).
    """
    g = query.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(g, 0)
    v = values.double().repeat_interleave(g, 0)
    p = (torch.einsum("hd,hnd->hn", query.double(), k) * scale).softmax(-1)
    return torch.einsum("hn,hnd->hd", p, v), p


def default_step(index: WaveIndex, query: torch.Tensor, scale: float, step: int) -> DecodeResult:
    """One decode through the index's own selection."""
    return index.decode(query, scale, return_positions=True)


def evaluate_policy(
    build: Callable[[torch.Tensor, torch.Tensor], WaveIndex],
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    top_k: int = 100,
    step: Step = default_step,
) -> AttentionAccuracy:
    """Prefill ``keys[:, :positions[0]]`` with ``build`` and decode every captured query.

    queries: [Hq, n_queries, D] post-RoPE queries at ``positions`` ([n_queries], consecutive,
    ascending); keys, values: [Hkv, N, D] covering every position. ``step`` runs one decode
    (default: the index's own selection) and must return exact positions.
    """
    hq, nq, _ = queries.shape
    hkv = keys.shape[0]
    g = hq // hkv
    start = int(positions[0])
    index = build(keys[:, :start], values[:, :start])
    errs = torch.empty(nq, hq, dtype=torch.float64)
    recall = torch.empty(nq, hq, dtype=torch.float64)
    retrieved = torch.empty(nq, dtype=torch.float64)
    for i, t in enumerate(positions.tolist()):
        if t + 1 > index.num_tokens:
            index.append(keys[:, index.num_tokens:t + 1], values[:, index.num_tokens:t + 1])
        q = queries[:, i]
        res = step(index, q, scale, i)
        ref, probs = exact_attention(q, keys[:, :t + 1], values[:, :t + 1], scale)
        errs[i] = (res.output.double() - ref).norm(dim=1) / ref.norm(dim=1)
        k = min(top_k, t + 1)
        top = probs.topk(k, dim=1).indices  # [Hq, k]
        read = torch.zeros(hkv, t + 1, dtype=torch.bool)
        for h in range(hkv):
            pos = res.exact_positions[h]
            read[h, pos[pos >= 0]] = True
        recall[i] = read.repeat_interleave(g, 0).gather(1, top).double().mean(1)
        retrieved[i] = res.n_exact.double().mean() - index.num_steady
    return AttentionAccuracy(errs, recall, retrieved)


def compare_policies(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    config: RetroConfig | None = None,
    top_k: int = 100,
) -> dict[str, AttentionAccuracy]:
    """The wave index against baselines at the same exact-token budget, on one layer.

    - ``wave``: the wave index at ``config`` (default budgets and estimator);
    - ``wave_centroid``: the same with the paper's estimator (``estimator='centroid'``);
    - ``wave_no_estimation``: the same retrieval zone, estimation zone dropped;
    - ``quest``: Quest-style pages, as many tokens per step as the wave index retrieved.
    Shapes as :func:`evaluate_policy`.
    """
    cfg = config or RetroConfig()
    no_est = cfg.replace(estimation_budget=0.0)
    centroid = cfg.replace(estimator="centroid")
    args = (queries, keys, values, positions, scale, top_k)
    wave = evaluate_policy(lambda k, v: WaveIndex.build(k, v, cfg), *args)
    budget = wave.retrieved_tokens

    def quest_step(index: WaveIndex, query: torch.Tensor, scale: float, i: int) -> DecodeResult:
        index.num_pages = max(0, round(float(budget[i]) / index.page_size))
        return index.decode(query, scale, return_positions=True)

    return {
        "wave": wave,
        "wave_centroid": evaluate_policy(lambda k, v: WaveIndex.build(k, v, centroid), *args),
        "wave_no_estimation": evaluate_policy(lambda k, v: WaveIndex.build(k, v, no_est), *args),
        "quest": evaluate_policy(lambda k, v: QuestIndex.build(k, v, no_est), *args,
                                 step=quest_step),
    }
