"""The device block cache of one (request, layer): page-sized blocks, per-head budgets.

Blocks of all KV heads share one pool (``k``/``v`` [num_blocks, page_size, D]); each head
owns a budget of blocks and a free list. A cluster is cached whole or not at all; which
clusters stay is the policy's decision (see :mod:`vllm_retro.buffer.policy`).
"""

from __future__ import annotations

import torch

from vllm_retro.buffer.stats import BufferStats


class DeviceBlockCache:
    """Block pool plus per-head free lists. Block ids are rows of ``k``/``v``."""

    def __init__(self, num_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, stats: BufferStats):
        self.head_dim = head_dim
        self.page_size = page_size
        self.stats = stats
        self.k = torch.zeros(0, page_size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.free_blocks: list[list[int]] = [[] for _ in range(num_heads)]
        self.capacity: list[int] = [0] * num_heads
        """Blocks owned by each head (free or holding a cached cluster)."""
        self.owner: list[int] = []
        """Head owning each block."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return int(self.k.shape[0])

    def nbytes(self) -> int:
        """Device bytes of the pool."""
        return 2 * self.k.numel() * self.k.element_size()

    def grow(self, head: int, blocks: int) -> None:
        """Give ``head`` ``blocks`` more blocks (the pool is reallocated; contents kept)."""
        if blocks <= 0:
            return
        first = self.num_blocks
        before = self.nbytes()
        extra = torch.zeros(blocks, self.page_size, self.head_dim, dtype=self.k.dtype,
                            device=self.k.device)
        self.k = torch.cat([self.k, extra])
        self.v = torch.cat([self.v, extra])
        self.free_blocks[head].extend(range(first, first + blocks))
        self.owner.extend([head] * blocks)
        self.capacity[head] += blocks
        self.stats.add(device_bytes=self.nbytes() - before)

    def free(self) -> None:
        """Release the pool."""
        self.stats.add(device_bytes=-self.nbytes())
        self.k = self.k[:0].clone()
        self.v = self.v[:0].clone()
        self.free_blocks = [[] for _ in self.free_blocks]
        self.owner = []
        self.capacity = [0] * len(self.capacity)
