"""Synthetic post-RoPE KV with cluster structure, and decode queries correlated with it.

Why not iid noise: with iid Gaussian keys every cluster's centroid is near the origin and
every cluster scores alike, so the index's top clusters are a random choice, the estimation
zone is trivially exact, and consecutive steps share no hot clusters — timing and counters
would describe a workload no model produces. Real post-RoPE keys are anisotropic and
clustered (a head's keys concentrate around a few directions, with most of their energy in
the low-frequency RoPE pairs, which barely rotate over the context). So keys here are a
mixture of Gaussians (``centers`` per layer and KV head) whose centers carry their energy
mostly in the low-frequency pairs, rotated by Llama-3's RoPE (theta 500000) at their
position; values are iid. Queries sit near one of their KV head's centers (so the keys drawn
around it are what attention, and retrieval, should find), drift slowly between steps (5% of
heads jump to another center per step, giving the steps temporal locality), and are rotated
at the decode position.
"""

from __future__ import annotations

import torch

ROPE_THETA = 500000.0
"""Llama-3's RoPE base."""
CENTERS = 512
"""Mixture components per (layer, KV head)."""
NOISE = 0.35
"""Per-dimension standard deviation of a key (or query) around its center."""
JUMP = 0.05
"""Probability per step that a query head moves to another center."""


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Llama's rotate-half RoPE. x: [..., N, D] (any float dtype), positions: [N] int.
    Returns fp32 [..., N, D]."""
    half = x.shape[-1] // 2
    inv = ROPE_THETA ** (-torch.arange(half, device=x.device, dtype=torch.float32) * 2
                         / x.shape[-1])
    ang = positions.to(x.device, torch.float32)[:, None] * inv  # [N, half]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class SyntheticStack:
    """Keys, values and queries of every layer of a stack, on ``device``.

    layers, kv_heads, q_heads, head_dim: the stack's shape; dtype: KV and query dtype.
    """

    def __init__(self, layers: int, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, seed: int):
        self.layers, self.q_heads, self.kv_heads, self.head_dim = layers, q_heads, kv_heads, \
            head_dim
        self.dtype, self.device = dtype, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        half = head_dim // 2
        # amplitude per RoPE pair: rises towards the low-frequency pairs (the last ones)
        amp = 0.3 + torch.linspace(0, 1, half, device=device) ** 2
        amp = torch.cat([amp, amp])
        centers = torch.randn(layers, kv_heads, CENTERS, head_dim, generator=self.gen,
                              device=device) * amp
        # |center|^2 / sqrt(D) = 16: RoPE's relative rotation and the centers' mutual
        # similarity (their energy sits in few pairs) eat much of that margin; at 4K context
        # the top 64 keys then hold ~95% of the attention mass (8: ~50%, diffuse).
        radius = (16 * head_dim ** 0.5) ** 0.5
        self.centers = torch.nn.functional.normalize(centers, dim=-1) * radius

    def context(self, layer: int, n: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and values of positions ``start .. start + n - 1`` of one request at
        ``layer``: each [H_kv, n, D] in the stack's dtype, contiguous."""
        h, d = self.kv_heads, self.head_dim
        which = torch.randint(0, CENTERS, (h, n), generator=self.gen, device=self.device)
        keys = torch.gather(self.centers[layer], 1, which[..., None].expand(h, n, d))
        keys = keys + NOISE * torch.randn(h, n, d, generator=self.gen, device=self.device)
        pos = torch.arange(start, start + n, device=self.device)
        keys = rope(keys, pos).to(self.dtype)
        values = torch.randn(h, n, d, generator=self.gen, device=self.device).to(self.dtype)
        return keys, values


class QueryWalk:
    """Decode queries of a batch over every layer, drifting slowly between steps."""

    def __init__(self, stack: SyntheticStack, batch: int):
        self.s = stack
        self.batch = batch
        group = stack.q_heads // stack.kv_heads
        self.kv_of_q = torch.arange(stack.q_heads, device=stack.device) // group
        self.pick = self._random_pick()

    def _random_pick(self) -> torch.Tensor:
        s = self.s
        return torch.randint(0, CENTERS, (s.layers, self.batch, s.q_heads), generator=s.gen,
                             device=s.device)

    def step(self, position: int) -> torch.Tensor:
        """Queries of the next decode step at ``position``: [L, B, H_q, D], stack dtype."""
        s = self.s
        jump = torch.rand(self.pick.shape, generator=s.gen, device=s.device) < JUMP
        self.pick = torch.where(jump, self._random_pick(), self.pick)
        layer = torch.arange(s.layers, device=s.device)[:, None, None].expand_as(self.pick)
        head = self.kv_of_q[None, None, :].expand_as(self.pick)
        q = s.centers[layer, head, self.pick]  # [L, B, Hq, D]
        q = q + NOISE * torch.randn(q.shape, generator=s.gen, device=s.device)
        pos = torch.tensor([position], device=s.device)
        return rope(q[..., None, :], pos)[..., 0, :].to(s.dtype)


def new_tokens(stack: SyntheticStack, batch: int, position: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one decoded token per request and layer at ``position``:
    each [L, B, H_kv, D] in the stack's dtype (keys from the same mixture, post-RoPE)."""
    s = stack
    shape = (s.layers, batch, s.kv_heads)
    which = torch.randint(0, CENTERS, shape, generator=s.gen, device=s.device)
    layer = torch.arange(s.layers, device=s.device)[:, None, None].expand(shape)
    head = torch.arange(s.kv_heads, device=s.device)[None, None, :].expand(shape)
    keys = s.centers[layer, head, which]
    keys = keys + NOISE * torch.randn(keys.shape, generator=s.gen, device=s.device)
    keys = rope(keys[..., None, :], torch.tensor([position], device=s.device))[..., 0, :]
    values = torch.randn(keys.shape, generator=s.gen, device=s.device)
    return keys.to(s.dtype), values.to(s.dtype)
