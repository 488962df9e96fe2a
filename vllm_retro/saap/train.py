"""SAAP's training (paper §4 and appendix A), for one layer at a time, all its KV heads at once.

1. **Key partition**: spherical k-means of the layer's de-RoPEd keys (sinks excluded),
   centred on their mean, ``C`` centroids from a random sample, a fixed number of rounds;
   an emptied centroid is re-seeded from a random key.
2. **Targets**: for sampled query positions, the attention each query head pays (the
   model's own softmax of post-RoPE ``q . k``) to the keys at least ``min_distance`` tokens
   back (the part a local window does not cover; sinks excluded), summed per bucket: the row
   of ``A H_k`` (eq. 1), normalised. Only *long-range* queries are kept -- those whose
   top-1 key (sinks aside) is at least ``min_query_distance`` back (appendix A).
3. **Query classifier** ``f_q``: ``Linear(D, F) -> BatchNorm -> ReLU -> Linear(F, C)`` on the
   de-RoPEd query, one per KV head (its GQA group's queries share it, as they share its
   buckets), trained with Adam on ``KL(A H_k || softmax(f_q(q)))`` (soft-label cross entropy,
   the same gradient); the batch norm's statistics are then measured over all the training
   queries.
4. **Quality** on held-out prompts: the share of the long-range attention mass held by the
   ``l`` buckets the classifier chooses, against the ``l`` nearest centroids to the query
   (symmetric k-means routing, the paper's "K-means (no rope)") and the best ``l`` buckets
   (oracle), and the fraction of the keys those buckets hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_retro.index.saap_model import rope


@dataclass(frozen=True)
class Pairs:
    """Which query-key pairs train SAAP."""

    sink_tokens: int
    """The first tokens of a prompt: attended exactly when served, never trained on."""
    min_distance: int
    """Keys closer than this to the query (the local window) are left out of the targets."""
    min_query_distance: int
    """A query is long-range (kept) when its top-1 key is at least this far back."""


def fit_centroids(keys: torch.Tensor, num_buckets: int, iters: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Spherical k-means per head (at most ``iters`` rounds; it stops once no key moves).
    keys: [H, N, D] de-RoPEd (any float dtype). Returns (means [H, D] fp32, unit centroids
    [H, C, D] fp32) of the keys centred on their means."""
    h, n, d = keys.shape
    if n < num_buckets:
        raise ValueError(f"{n} keys cannot seed {num_buckets} buckets")
    x = keys.float()
    mean = x.mean(1)
    x = torch.nn.functional.normalize(x - mean[:, None], dim=-1)
    init = torch.stack([torch.randperm(n, generator=generator)[:num_buckets] for _ in range(h)])
    cent = torch.gather(x, 1, init[..., None].expand(h, num_buckets, d))
    prev = None
    for _ in range(iters):
        assign = torch.bmm(x, cent.transpose(1, 2)).argmax(-1)  # [H, N]
        if prev is not None and torch.equal(assign, prev):
            break  # converged: the centroids are their members' normalised means
        prev = assign
        sums = torch.zeros(h, num_buckets, d).scatter_add_(
            1, assign[..., None].expand(h, n, d), x)
        counts = torch.zeros(h, num_buckets).scatter_add_(1, assign, torch.ones(h, n))
        new = torch.nn.functional.normalize(sums, dim=-1)
        empty = counts == 0
        if empty.any():
            pick = torch.randint(0, n, (h, num_buckets), generator=generator)
            new = torch.where(empty[..., None], torch.gather(
                x, 1, pick[..., None].expand(h, num_buckets, d)), new)
        cent = new
    return mean, cent


def assign_keys(keys: torch.Tensor, mean: torch.Tensor, centroids: torch.Tensor
                ) -> torch.Tensor:
    """Bucket of each de-RoPEd key: keys [H, N, D], mean [H, D], centroids [H, C, D]
    -> [H, N] int64 (the largest cosine)."""
    x = keys.float() - mean[:, None]
    return torch.bmm(x, centroids.transpose(1, 2)).argmax(-1)


def bucket_mass(queries: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor,
                buckets: torch.Tensor, num_buckets: int, inv_freq: torch.Tensor,
                rope_scale: float, scale: float, pairs: Pairs, chunk: int = 256
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The long-range attention mass per bucket of sampled queries of one prompt.

    queries: [Hq, S, D] de-RoPEd at positions q_pos [S]; keys: [Hkv, T, D] de-RoPEd at
    positions 0..T-1; buckets: [Hkv, T]. Returns (mass [Hq, S, C] fp32, rows summing to 1
    (0 where no key is far enough); long_range [Hq, S] bool; key_share [Hq, S, C] fp32, the
    fraction of the far-enough keys in each bucket; far [Hq, S] fp32, the share of the
    query's whole attention (sinks and window included) on the far-enough keys)."""
    hq, s, _ = queries.shape
    hkv, t, _ = keys.shape
    g = hq // hkv
    k_rot = rope(keys, torch.arange(t), inv_freq, rope_scale)  # [Hkv, T, D]
    mass = torch.zeros(hq, s, num_buckets)
    share = torch.zeros(hq, s, num_buckets)
    long_range = torch.zeros(hq, s, dtype=torch.bool)
    far_share = torch.zeros(hq, s)
    kpos = torch.arange(t)
    for a in range(0, s, chunk):
        pos = q_pos[a:a + chunk]
        q_rot = rope(queries[:, a:a + chunk], pos, inv_freq, rope_scale)  # [Hq, c, D]
        c = pos.shape[0]
        logits = torch.bmm(q_rot.reshape(hkv, g * c, -1), k_rot.transpose(1, 2)) * scale
        logits = logits.reshape(hkv, g, c, t)
        causal = kpos[None, :] <= pos[:, None]  # [c, T]
        far = causal & (kpos[None, :] <= pos[:, None] - pairs.min_distance)
        far &= kpos[None, :] >= pairs.sink_tokens
        full = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        far_share[:, a:a + c] = (full * far).sum(-1).reshape(hq, c)
        candidates = causal & (kpos[None, :] >= pairs.sink_tokens)
        top = full.masked_fill(~candidates, -1.0).argmax(-1)  # [Hkv, G, c]
        lr = ((pos[None, None, :] - top) >= pairs.min_query_distance) & candidates.any(-1)
        long_range[:, a:a + c] = lr.reshape(hq, c)
        p = torch.softmax(logits.masked_fill(~far, float("-inf")), dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # no far key: no mass
        idx = buckets[:, None, None, :].expand(hkv, g, c, t)
        m = torch.zeros(hkv, g, c, num_buckets).scatter_add_(3, idx, p)
        mass[:, a:a + c] = m.reshape(hq, c, num_buckets)
        cnt = torch.zeros(hkv, c, num_buckets).scatter_add_(
            2, buckets[:, None, :].expand(hkv, c, t), far[None].float().expand(hkv, c, t))
        cnt = cnt / cnt.sum(-1, keepdim=True).clamp_min(1)
        share[:, a:a + c] = cnt[:, None].expand(hkv, g, c, num_buckets).reshape(hq, c, -1)
    return mass, long_range, share, far_share


class Classifier(torch.nn.Module):
    """``f_q`` for every KV head of a layer at once: ``Linear(D, F) -> BatchNorm -> ReLU ->
    Linear(F, C)`` per head, on inputs [H, B, D] (logits [H, B, C])."""

    def __init__(self, heads: int, dim: int, hidden: int, buckets: int,
                 generator: torch.Generator, eps: float = 1e-5):
        super().__init__()
        b1 = dim ** -0.5
        b2 = hidden ** -0.5
        self.w1 = torch.nn.Parameter((torch.rand(heads, hidden, dim, generator=generator) * 2
                                      - 1) * b1)
        self.b1 = torch.nn.Parameter((torch.rand(heads, hidden, generator=generator) * 2 - 1)
                                     * b1)
        self.bn_weight = torch.nn.Parameter(torch.ones(heads, hidden))
        self.bn_bias = torch.nn.Parameter(torch.zeros(heads, hidden))
        self.w2 = torch.nn.Parameter((torch.rand(heads, buckets, hidden, generator=generator)
                                      * 2 - 1) * b2)
        self.b2 = torch.nn.Parameter(torch.zeros(heads, buckets))
        self.register_buffer("bn_mean", torch.zeros(heads, hidden))
        self.register_buffer("bn_var", torch.ones(heads, hidden))
        self.eps = eps

    def hidden_pre(self, x: torch.Tensor) -> torch.Tensor:
        """The first layer's output before the batch norm: [H, B, F]."""
        return torch.baddbmm(self.b1[:, None], x, self.w1.transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [H, B, C]; batch statistics in training mode, the stored ones in eval."""
        z = self.hidden_pre(x)
        if self.training:
            var, mean = torch.var_mean(z, dim=1, unbiased=False)
        else:
            mean, var = self.bn_mean, self.bn_var
        z = (z - mean[:, None]) / torch.sqrt(var[:, None] + self.eps)
        z = torch.relu(z * self.bn_weight[:, None] + self.bn_bias[:, None])
        return torch.baddbmm(self.b2[:, None], z, self.w2.transpose(1, 2))

    @torch.no_grad()
    def set_statistics(self, x: torch.Tensor, counts: torch.Tensor) -> None:
        """The batch norm's statistics over every training input: x [H, N, D] (rows past
        ``counts[h]`` are padding)."""
        z = self.hidden_pre(x)
        valid = (torch.arange(x.shape[1])[None, :] < counts[:, None]).float()[..., None]
        n = counts.clamp_min(1).float()[:, None]
        mean = (z * valid).sum(1) / n
        self.bn_mean.copy_(mean)
        self.bn_var.copy_((((z - mean[:, None]) ** 2) * valid).sum(1) / n)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The file's classifier tensors ([H, ...] each, fp32)."""
        return {name: getattr(self, name).detach().float().clone()
                for name in ("w1", "b1", "bn_weight", "bn_bias", "bn_mean", "bn_var", "w2",
                             "b2")}


def train_classifier(x: torch.Tensor, y: torch.Tensor, counts: torch.Tensor, hidden: int,
                     steps: int, batch_size: int, lr: float, generator: torch.Generator,
                     weights: torch.Tensor | None = None,
                     on_step: Callable[[int, float], None] | None = None) -> Classifier:
    """Train one layer's classifiers. x: [H, N, D] de-RoPEd queries, y: [H, N, C] their
    targets (rows summing to 1), rows past ``counts[h]`` padding; ``weights`` [H, N]: each
    query's weight in the loss (None: equal). Adam, cosine learning-rate decay.
    ``on_step(step, loss)`` after each step. Returns the classifier in eval mode, its batch
    norm's statistics set."""
    h, _, d = x.shape
    c = y.shape[2]
    model = Classifier(h, d, hidden, c, generator)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, steps) / max(steps, 1))))
    model.train()
    for step in range(steps):
        pick = (torch.rand(h, batch_size, generator=generator) * counts[:, None]).long()
        xb = torch.gather(x, 1, pick[..., None].expand(h, batch_size, d))
        yb = torch.gather(y, 1, pick[..., None].expand(h, batch_size, c))
        ce = -(yb * torch.log_softmax(model(xb), dim=-1)).sum(-1)  # [H, B]
        if weights is None:
            loss = ce.mean()
        else:
            wb = torch.gather(weights, 1, pick)
            loss = ((ce * wb).sum(1) / wb.sum(1).clamp_min(1e-12)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, float(loss.detach()))
    model.eval()
    model.set_statistics(x, counts)
    return model


def top_mass(scores: torch.Tensor, mass: torch.Tensor, share: torch.Tensor, probes: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass held, key share held) by each row's top ``probes`` buckets by ``scores``:
    scores, mass, share [..., C] -> two [...] tensors."""
    top = torch.topk(scores, probes, dim=-1).indices
    return mass.gather(-1, top).sum(-1), share.gather(-1, top).sum(-1)


QUALITY_KEYS = ("recall_saap", "recall_kmeans", "recall_oracle", "served_saap",
                "served_kmeans", "served_oracle", "selectivity")


@dataclass
class QualityCounts:
    """Sums over held-out queries, reduced to a :meth:`summary`."""

    queries: int = 0
    """Long-range (query, head) pairs."""
    recall_saap: float = 0.0
    recall_kmeans: float = 0.0
    recall_oracle: float = 0.0
    far: float = 0.0
    """Sum of the far attention share over every (step, head)."""
    served_saap: float = 0.0
    served_kmeans: float = 0.0
    served_oracle: float = 0.0
    steps: int = 0
    """(step, query head) pairs."""
    selectivity: float = 0.0

    def add(self, other: QualityCounts) -> None:
        """Accumulate ``other``."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> dict[str, float]:
        """Means over the held-out queries:

        - ``recall_saap`` / ``recall_kmeans`` / ``recall_oracle``: per query head, on the
          long-range queries (the paper's training distribution), the share of the attention
          beyond the window held by the ``l`` buckets the classifier chooses / nearest to
          the query / best;
        - ``served_*``: as served -- buckets chosen once per GQA group at every sampled
          step (summed softmaxes; summed cosines for k-means), and each step weighted by its
          attention beyond the window: the share of all the attention beyond the window the
          visited buckets hold;
        - ``selectivity``: the fraction of the keys beyond the window SAAP reads, served;
        - ``queries``: long-range (query, head) pairs."""
        q, s, f = max(self.queries, 1), max(self.steps, 1), max(self.far, 1e-12)
        return {"queries": self.queries,
                "recall_saap": self.recall_saap / q, "recall_kmeans": self.recall_kmeans / q,
                "recall_oracle": self.recall_oracle / q,
                "served_saap": self.served_saap / f, "served_kmeans": self.served_kmeans / f,
                "served_oracle": self.served_oracle / f, "selectivity": self.selectivity / s}


@torch.no_grad()
def evaluate(model: Classifier, centroids: torch.Tensor, queries: torch.Tensor,
             mass: torch.Tensor, share: torch.Tensor, long_range: torch.Tensor,
             far: torch.Tensor, probes: int) -> QualityCounts:
    """Held-out quality of one prompt (see :meth:`QualityCounts.summary`). queries
    [Hq, S, D] de-RoPEd; mass, share [Hq, S, C]; long_range, far [Hq, S]; centroids
    [Hkv, C, D]."""
    hq, s, d = queries.shape
    hkv = centroids.shape[0]
    g = hq // hkv
    probes = min(probes, centroids.shape[1])
    qg = queries.float().reshape(hkv, g * s, d)
    prob = torch.softmax(model(qg), dim=-1).reshape(hq, s, -1)
    cos = torch.bmm(torch.nn.functional.normalize(qg, dim=-1), centroids.transpose(1, 2))
    cos = cos.reshape(hq, s, -1)
    keep = long_range & (mass.sum(-1) > 0.5)
    out = QualityCounts(queries=int(keep.sum()), steps=hq * s, far=float(far.sum()))
    out.recall_saap = float(top_mass(prob, mass, share, probes)[0][keep].sum())
    out.recall_kmeans = float(top_mass(cos, mass, share, probes)[0][keep].sum())
    out.recall_oracle = float(top_mass(mass, mass, share, probes)[0][keep].sum())

    def grouped(x: torch.Tensor) -> torch.Tensor:  # one ranking per GQA group and step
        return x.reshape(hkv, g, s, -1).sum(1, keepdim=True).expand(hkv, g, s, -1).reshape(
            hq, s, -1)

    held, sel = top_mass(grouped(prob), mass, share, probes)
    out.served_saap = float((held * far).sum())
    out.selectivity = float(sel.sum())
    out.served_kmeans = float((top_mass(grouped(cos), mass, share, probes)[0] * far).sum())
    out.served_oracle = float((top_mass(grouped(mass * far[..., None]), mass, share, probes)[0]
                               * far).sum())
    return out
