"""The tilted estimator of the estimation zone: its build-time statistics and per-query terms.

The paper (eq. 2-4) weights an estimated cluster of ``n`` keys ``k_i`` with centroid ``C`` by
``n * exp(s q.C)`` (``s`` the softmax scale) and gives it the mean value. Its true mass is
``n * exp(s q.C) * E_i[exp(X_i)]`` with ``X_i = s q.(k_i - C)``; Jensen makes the factor
``E_i[exp(X_i)] >= 1``, so the paper's weight is a lower bound, and on real keys (clusters of
~16 keys in 64-128 dimensions are not tight) often 2-5x too small. The tilted estimator
corrects both the mass and the value:

- **Variance of X.** ``var_i(X_i) = s^2 q^T S_c q`` with ``S_c`` the cluster's residual key
  covariance. We keep one number per cluster, its *spread* ``tr S_c`` (mean squared
  distance of its keys from ``C``), and per KV head the *profile* ``p`` (the per-dimension
  share of residual key variance, pooled over the head's clusters, summing to 1):
  ``v = spread_c * s^2 * sum_j q_j^2 p_j``. (On Qwen2.5 attention data a per-cluster
  per-dimension variance, a whole head_dim vector per cluster, does no better.)
- **Mass.** ``X`` is modelled as a normal truncated at ``a(n)`` standard deviations and
  rescaled to variance ``v``, where ``a(n)`` is the expected largest of ``n`` standard
  normal deviates (Blom): a cluster is a finite sample, with no keys beyond its extremes. The
  factor is that distribution's moment generating function
  (:func:`kernels.tripartite_attention.log_tilt_ref`). It is ``exp(v/2)`` (the log-normal
  correction) for small ``v`` but grows like ``exp(c sqrt v)`` for large ``v``, where the plain
  log-normal correction overshoots by orders of magnitude (for ``n`` Gaussian keys it tracks
  the true factor within a few percent at n = 16, where ``exp(v/2)`` is off by up to 2.6x in
  log), and it never drops below 1 (the Jensen bound).
- **Value.** For jointly normal keys and values the ``exp(s q.k)``-tilted mean of ``v`` is
  ``mean v + s Sigma_vk q`` (``Sigma_vk`` the cluster's value-key cross-covariance). We model
  ``Sigma_vk,c = spread_c * P`` with ``P`` the head's pooled cross-covariance divided by its
  pooled residual trace, kept as rank-``rank`` factors: the value becomes
  ``VS_c / n + spread_c * vshift`` with ``vshift = s P q`` shared by all clusters, and it is
  weighted by the corrected mass.

Bytes read per estimated cluster grow by two fp32 scalars (spread, ``a(n)``); per KV head and
step by ``(2 * rank + 1) * head_dim`` fp32 numbers (profile and factors), far less than one
head_dim vector per estimated cluster once a context has a few hundred clusters.
"""

from __future__ import annotations

import torch

from vllm_retro.kernels.tripartite_attention import residual_query_terms

POWER_STEPS = 2
"""Block-power steps that refine the factors when a decode-time block is added."""

DEFAULT_RANK = 8
"""Rank of the pooled value-key cross-covariance (rank 8 matches full rank on Qwen2.5 data)."""


def expected_max_deviate(sizes: torch.Tensor) -> torch.Tensor:
    """Blom's approximation of the expected largest of ``n`` standard normal samples,
    ``Phi^-1((n - 3/8) / (n + 1/4))``, for cluster sizes ``sizes`` (any shape, ints); 0 where
    ``n <= 1`` (a single key has no spread). Returns fp32 of the same shape."""
    n = sizes.double()
    a = torch.special.ndtri(((n - 0.375) / (n + 0.25)).clamp(0.5, 1.0 - 1e-12))
    return torch.where(n > 1, a, torch.zeros_like(a)).float()


class ResidualModel:
    """Pooled residual moments of one request-layer's indexed keys and values, per KV head,
    and the per-query terms of the tilted estimator derived from them.

    Keeps the running sums (``key_sq`` [H, D], ``cross`` [H, D, D], fp32) so blocks added at
    decode time refine the same model; :meth:`add` refreshes the profile and the factors.
    The first block's factors are an exact truncated SVD; later blocks (decode-time update
    blocks, which move the pooled moments a little) refine them by ``POWER_STEPS``
    block-power steps from the current key directions and the best rank-``rank``
    factorisation within the refined directions (Rayleigh-Ritz): O(D^2 rank) per head
    instead of an O(D^3) SVD, so landing an update block costs no decode step a full
    decomposition (~15-25 ms at 8 heads x 128).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, device: torch.device,
                 rank: int = DEFAULT_RANK):
        if not 1 <= rank <= head_dim:
            raise ValueError(f"rank={rank} is invalid; accepted: an integer in [1, {head_dim}]")
        h, d = num_kv_heads, head_dim
        self.rank = rank
        self.key_sq = torch.zeros(h, d, dtype=torch.float32, device=device)
        self.cross = torch.zeros(h, d, d, dtype=torch.float32, device=device)
        self.profile = torch.zeros(h, d, dtype=torch.float32, device=device)
        self.value_factor = torch.zeros(h, d, rank, dtype=torch.float32, device=device)
        self.key_factor = torch.zeros(h, d, rank, dtype=torch.float32, device=device)
        self._factored = False
        """Every head's factors come from an SVD of a non-zero matrix (later blocks refine
        them incrementally)."""
        self.tilted_heads = torch.ones(h, dtype=torch.bool, device=device)
        """[H] heads whose terms are kept; the others' profile and value factors are zero, so
        their estimated clusters get the paper's weight and mean value exactly (a zero
        variance tilts nothing), on every decode path (see :meth:`set_tilted_heads`)."""
        self._all_tilted = True

    def set_tilted_heads(self, heads: torch.Tensor) -> None:
        """Keep the tilted estimator on ``heads`` ([H] bool) only; the rest estimate by
        centroid from now on (blocks added later included). Set at build, before the first
        decode: the decode paths' batch views read the terms when a block joins."""
        self.tilted_heads = heads.to(dtype=torch.bool, device=self.profile.device)
        self._all_tilted = bool(self.tilted_heads.all())  # (add() must not sync a device)
        self._mask_heads()

    def _mask_heads(self) -> None:
        keep = self.tilted_heads
        self.profile = self.profile * keep[:, None]
        self.value_factor = (self.value_factor * keep[:, None, None]).contiguous()

    def add(self, key_sq: torch.Tensor, cross: torch.Tensor) -> None:
        """Fold in a block's residual sums (key_sq [H, D], cross [H, D, D], see
        :class:`~vllm_retro.index.clustering.Clusters`) and refresh the derived terms."""
        self.key_sq += key_sq.to(self.key_sq)
        self.cross += cross.to(self.cross)
        trace = self.key_sq.sum(-1, keepdim=True)  # [H, 1] pooled residual energy
        ok = trace > 0
        safe = torch.where(ok, trace, torch.ones_like(trace))
        self.profile = torch.where(ok, self.key_sq / safe, torch.zeros_like(self.key_sq))
        m = torch.where(ok[..., None], self.cross / safe[..., None], torch.zeros_like(self.cross))
        if self._factored:
            q = self.key_factor
            for _ in range(POWER_STEPS):
                q = torch.linalg.qr(m.transpose(1, 2) @ (m @ q)).Q  # [H, D, r]
            u, sv, wh = torch.linalg.svd(m @ q, full_matrices=False)  # [H, D, r], [H, r]
            self.value_factor = (u * sv[:, None, :]).contiguous()
            self.key_factor = (q @ wh.transpose(1, 2)).contiguous()
        else:
            u, sv, vh = torch.linalg.svd(m)
            self.value_factor = (u[..., :self.rank] * sv[:, None, :self.rank]).contiguous()
            self.key_factor = vh[:, :self.rank, :].transpose(1, 2).contiguous()
            self._factored = bool(ok.all())
        if not self._all_tilted:
            self._mask_heads()

    def query_terms(self, query: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-query terms for query [H, G, D] (G query heads per KV head): ``qvar`` [H, G],
        the variance of ``scale * q.(k - C)`` per unit of spread, and ``vshift`` [H, G, D],
        the value shift per unit of spread (both fp32)."""
        return residual_query_terms(query, self.profile, self.key_factor, self.value_factor,
                                    scale)

    def nbytes(self) -> int:
        """Bytes held (running sums, profile and factors)."""
        return sum(t.numel() * t.element_size() for t in (
            self.key_sq, self.cross, self.profile, self.value_factor, self.key_factor,
            self.tilted_heads))
