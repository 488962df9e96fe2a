"""Product quantisation of keys (Jégou et al., 2011), as the PQCache baseline uses it.

Per KV head the head dimension is cut into ``m`` equal contiguous sub-spaces; each gets a
codebook of ``2 ** bits`` codewords by Euclidean k-means over the indexed keys' sub-vectors,
and every key one code per sub-space. A query's approximate logits ``q . k_hat`` are sums of
per-sub-space lookup tables (``q_s . codeword``) indexed by the codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProductQuantizer:
    """Codebooks of one (request, layer), every KV head and sub-space fitted independently."""

    codebooks: torch.Tensor
    """[H, m, K, D / m] fp32 codewords (K = 2 ** bits, or fewer when fitted on fewer keys)."""

    @property
    def num_subspaces(self) -> int:
        """m, the number of sub-spaces."""
        return int(self.codebooks.shape[1])

    @property
    def num_codewords(self) -> int:
        """K, codewords per sub-space."""
        return int(self.codebooks.shape[2])


def _split(x: torch.Tensor, m: int) -> torch.Tensor:
    """[H, N, D] -> [H * m, N, D / m] fp32, sub-space-major per head."""
    h, n, d = x.shape
    return x.float().reshape(h, n, m, d // m).permute(0, 2, 1, 3).reshape(h * m, n, d // m)


def _nearest(x: torch.Tensor, codewords: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """x: [S, N, d], codewords: [S, K, d] -> [S, N] int64 index of the nearest codeword.

    In chunks of ``chunk`` points, so the [S, chunk, K] distances stay in cache (at 128K
    keys the unchunked [S, N, K] buffer made encoding 6x slower)."""
    # argmin ||x - c||^2 == argmin (||c||^2 - 2 x . c); ||x||^2 is constant per point
    c2 = codewords.square().sum(-1)[:, None, :]
    ct = codewords.transpose(1, 2)
    out = torch.empty(x.shape[:2], dtype=torch.int64, device=x.device)
    for s in range(0, x.shape[1], chunk):
        out[:, s:s + chunk] = torch.baddbmm(c2, x[:, s:s + chunk], ct, alpha=-2).argmin(-1)
    return out


def _kmeans_pp_init(x: torch.Tensor, k: int, seed: int = 0) -> torch.Tensor:
    """k-means++ seeding on a batch of point sets x [S, N, d]: [S, k, d] codewords.

    Strided or uniform seeding often leaves a dense group of keys without a codeword of its
    own, which Lloyd iterations never repair; D^2 sampling almost never does.
    """
    s, n, _ = x.shape
    gen = torch.Generator(device=x.device).manual_seed(seed)
    rows = torch.arange(s, device=x.device)
    first = torch.randint(n, (s,), generator=gen, device=x.device)
    x2 = x.square().sum(-1)  # [S, N]

    def dist2(c: torch.Tensor) -> torch.Tensor:  # [S, d] -> [S, N]
        return x2 - 2 * torch.bmm(x, c[:, :, None])[..., 0] + c.square().sum(-1)[:, None]

    chosen = [x[rows, first]]
    d2 = dist2(chosen[0])
    for _ in range(1, k):
        w = d2.clamp_min(0)
        w = torch.where(w.sum(1, keepdim=True) > 0, w, torch.ones_like(w))  # all points equal
        nxt = x[rows, torch.multinomial(w, 1, generator=gen)[:, 0]]
        chosen.append(nxt)
        d2 = torch.minimum(d2, dist2(nxt))
    return torch.stack(chosen, dim=1)


def fit_pq(keys: torch.Tensor, subspaces: int, bits: int, iters: int,
           sample: int | None = None) -> ProductQuantizer:
    """Fit codebooks on keys [H, N, D] (N >= 1; D divisible by ``subspaces``).

    Euclidean k-means per (head, sub-space) with ``min(2 ** bits, N)`` codewords, seeded by
    k-means++ (a fixed generator: deterministic); an emptied codeword keeps its value.
    ``sample``: fit on at most this many keys, evenly spaced (as product quantisers are
    trained, e.g. faiss's 256 points per codeword), so the cost does not grow with N.
    """
    h, n, d = keys.shape
    if subspaces < 1 or d % subspaces:
        raise ValueError(f"subspaces={subspaces} must be positive and divide head_dim={d}")
    if not 1 <= bits <= 16:
        raise ValueError(f"bits={bits}; accepted: an integer in [1, 16]")
    if n < 1:
        raise ValueError("fit_pq needs at least one key")
    if sample is not None and n > sample:
        keys = keys[:, torch.linspace(0, n - 1, sample, device=keys.device).long()]
        n = sample
    x = _split(keys, subspaces)  # [S, N, ds]
    codewords = _kmeans_pp_init(x, min(2 ** bits, n))
    for _ in range(iters):
        assign = _nearest(x, codewords)
        sums = torch.zeros_like(codewords).scatter_add_(
            1, assign[..., None].expand_as(x), x)
        counts = torch.zeros(codewords.shape[:2], device=x.device).scatter_add_(
            1, assign, torch.ones_like(assign, dtype=torch.float32))
        codewords = torch.where(counts[..., None] > 0,
                                sums / counts.clamp_min(1.0)[..., None], codewords)
    return ProductQuantizer(codewords.reshape(h, subspaces, -1, d // subspaces))


def pq_encode(pq: ProductQuantizer, keys: torch.Tensor) -> torch.Tensor:
    """Codes of keys [H, N, D]: [H, N, m] int64 (nearest codeword per sub-space)."""
    h, n, _ = keys.shape
    m = pq.num_subspaces
    codewords = pq.codebooks.reshape(h * m, pq.num_codewords, -1)
    return _nearest(_split(keys, m), codewords).reshape(h, m, n).transpose(1, 2)


def pq_decode(pq: ProductQuantizer, codes: torch.Tensor) -> torch.Tensor:
    """Reconstructed keys from codes [H, N, m]: [H, N, D] fp32."""
    h, n, m = codes.shape
    ds = pq.codebooks.shape[-1]
    idx = codes.transpose(1, 2)[..., None].expand(h, m, n, ds)
    return torch.gather(pq.codebooks, 2, idx).permute(0, 2, 1, 3).reshape(h, n, m * ds)


def pq_logits(pq: ProductQuantizer, codes: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Approximate ``q . k`` by lookup tables. query: [H, G, D]; codes: [H, N, m].

    Returns [H, G, N] fp32 ``sum_s q_s . codebook_s[code_s]`` (unscaled).
    """
    h, g, d = query.shape
    n, m = codes.shape[1], pq.num_subspaces
    lut = torch.einsum("hgmd,hmkd->hgmk", query.float().reshape(h, g, m, d // m), pq.codebooks)
    idx = codes.transpose(1, 2)[:, None].expand(h, g, m, n)
    return torch.gather(lut, 3, idx).sum(2)
