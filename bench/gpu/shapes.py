"""Stack shapes, presets and the memory estimates behind skipped configurations."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from vllm_retro.config import RetroConfig

GiB = 1 << 30


@dataclass(frozen=True)
class StackShape:
    """Attention stack geometry: ``layers`` layers of GQA attention."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    def to_dict(self) -> dict[str, int]:
        """Plain dict for the JSON output."""
        return asdict(self)


FULL = StackShape(layers=32, q_heads=32, kv_heads=8, head_dim=128)
"""Llama-3-8B: 32 layers, 32 query heads, 8 KV heads, head_dim 128."""
REDUCED = StackShape(layers=2, q_heads=8, kv_heads=4, head_dim=64)
"""A CPU-sized stack (well under a minute on 2 cores at 4K context)."""


def _pow2ceil(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, x))))


def estimate_bytes(shape: StackShape, elem: int, context: int, batch: int, extra_tokens: int,
                   cfg: RetroConfig, pinned: bool) -> dict[str, int]:
    """Estimated bytes of one (context, batch) case.

    ``dense_device``: the dense stack's KV (context + ``extra_tokens`` decoded) on the device.
    ``retro_device``: the wave index's meta index (one centroid and one value sum per
    ``cluster_size`` tokens) plus the layers' execution buffers (the retrieval zone's tokens,
    ``retrieval_budget`` of the context; the stack keeps no device cache of clusters).
    ``workspace``: prefill timing (q/k/v of one layer), generation
    temporaries and a 2 GiB margin. ``retro_host``: the host tier (1.5x page padding; PyTorch's
    pinned host allocator rounds every block up to a power of two) plus a few staging copies.
    """
    per_head = context * shape.head_dim * elem  # one K (or V) of one request-layer-head
    kv = 2 * shape.layers * batch * shape.kv_heads * per_head
    dense = kv + 2 * shape.layers * batch * shape.kv_heads * extra_tokens * shape.head_dim * elem
    retro_dev = int(kv * (1 / cfg.cluster_size + cfg.retrieval_budget))
    workspace = (2 * GiB + (shape.q_heads + 2 * shape.kv_heads) * per_head
                 + 4 * shape.kv_heads * context * shape.head_dim * 4)
    tier = 1.5 * shape.kv_heads * per_head
    tier_bytes = _pow2ceil(tier) if pinned else int(tier)
    staging = 8 * (_pow2ceil(shape.kv_heads * per_head) if pinned else shape.kv_heads * per_head)
    host = 2 * shape.layers * batch * tier_bytes + staging
    return {"dense_device": dense, "retro_device": retro_dev, "workspace": workspace,
            "retro_host": host}


def host_ram_bytes() -> int:
    """Physical memory of this machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def skip_reason(est: dict[str, int], device_type: str, device_bytes: int,
                host_limit: int) -> str | None:
    """Why a case with estimates ``est`` cannot run (None if it fits).

    On CUDA the dense KV, the retro device state and the workspace must fit in 90% of
    ``device_bytes``, and the host tier in ``host_limit``. On CPU the device *is* the host:
    dense KV and host tier together must fit in ``host_limit``.
    """
    if device_type == "cuda":
        need = est["dense_device"] + est["retro_device"] + est["workspace"]
        if need > 0.9 * device_bytes:
            return (f"device memory: dense KV {est['dense_device'] / GiB:.1f} GiB + retro "
                    f"{est['retro_device'] / GiB:.1f} GiB + workspace "
                    f"{est['workspace'] / GiB:.1f} GiB > 90% of {device_bytes / GiB:.1f} GiB")
        if est["retro_host"] > host_limit:
            return (f"host memory: retro host tier ~{est['retro_host'] / GiB:.1f} GiB "
                    f"(pinned, power-of-two blocks) > limit {host_limit / GiB:.1f} GiB")
        return None
    need = est["dense_device"] + est["retro_host"]
    if need > host_limit:
        return (f"host memory: dense KV + retro host tier ~{need / GiB:.1f} GiB > limit "
                f"{host_limit / GiB:.1f} GiB")
    return None
