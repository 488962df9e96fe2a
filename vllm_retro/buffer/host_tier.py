"""The host tier: indexed KV of one (request, layer), cluster-contiguous, in fixed pages.

Every cluster starts on a page boundary and occupies ``ceil(size / page_size)`` consecutive
pages (the last one padded), so a cluster is one contiguous host range and a page is the
unit of the device block cache. Pages live in one pool per (request, layer) for all KV
heads, grown geometrically as update blocks arrive; the pool is pinned when CUDA is
present, so the gather kernel reads it directly.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_retro.buffer.stats import BufferStats

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's raw elements (same shape, an integer type of the same
    width), so rows can be copied with numpy whatever the dtype (numpy has no bfloat16).

    The buffer's worker thread moves bytes with numpy rather than torch: a torch CPU op run
    on a second thread starts a second OpenMP team, which then competes for the cores with
    the decode path (measured: ~1.7x slower decode steps on 2 cores).
    """
    return t.view(_BITS[t.element_size()]).numpy()


class HostTier:
    """Page pool of keys and values: ``k``/``v`` [capacity_pages, page_size, D]."""

    def __init__(self, head_dim: int, page_size: int, dtype: torch.dtype, stats: BufferStats,
                 pin: bool | None = None):
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.stats = stats
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.k = self._alloc(0)
        self.v = self._alloc(0)
        self.positions = torch.full((0,), -1, dtype=torch.int64)
        """[capacity_pages * page_size] absolute token position of each row (-1 = padding)."""
        self.used_pages = 0
        self.generation = 0
        """Pools replaced so far (a growth replaces ``k``, ``v`` and ``positions``)."""

    def _alloc(self, pages: int) -> torch.Tensor:
        return torch.zeros(pages, self.page_size, self.head_dim, dtype=self.dtype,
                           pin_memory=self.pin)

    @property
    def capacity_pages(self) -> int:
        """Pages allocated."""
        return int(self.k.shape[0])

    def nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return 2 * self.k.numel() * self.k.element_size()

    def reserve(self, pages: int, headroom: int = 0) -> int:
        """Claim ``pages`` more pages; returns the first claimed page. When the pool is full
        it grows (see :meth:`ensure_room`), to ``headroom`` pages beyond the claim if it was
        empty (a first allocation copies nothing, so the room for the next block is free
        to take now). Called from the update worker, so it copies with numpy (see
        :func:`bits`)."""
        start = self.used_pages
        self.ensure_room(pages + (headroom if self.capacity_pages == 0 else 0))
        self.used_pages = start + pages
        return start

    def ensure_room(self, pages: int) -> bool:
        """Grow the pool (by >= 1.5x, copying the used pages) unless ``pages`` more fit;
        True when it grew. The grown pool replaces the old one whole, after the copy, so
        a reader holding the old pool still reads every page laid out before."""
        need = self.used_pages + pages
        if need <= self.capacity_pages:
            return False
        cap = max(need, (3 * self.capacity_pages) // 2)
        before = self.nbytes()
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty(cap, self.page_size, self.head_dim, dtype=self.dtype,
                              pin_memory=self.pin)
            new_np = bits(new)
            new_np[: self.used_pages] = bits(old)[: self.used_pages]
            new_np[self.used_pages:] = 0
            setattr(self, name, new)
        pos = np.full(cap * self.page_size, -1, dtype=np.int64)
        pos[: self.positions.numel()] = self.positions.numpy()
        self.positions = torch.from_numpy(pos)
        self.generation += 1
        self.stats.add(host_bytes=self.nbytes() - before)
        return True

    def write_rows(self, rows: np.ndarray, keys: np.ndarray, values: np.ndarray,
                   positions: np.ndarray) -> None:
        """Store token rows. rows: [n] flat row ids (page * page_size + slot); keys/values
        [n, D] as :func:`bits` views of the KV dtype; positions [n] absolute positions."""
        bits(self.k).reshape(-1, self.head_dim)[rows] = keys
        bits(self.v).reshape(-1, self.head_dim)[rows] = values
        self.positions.numpy()[rows] = positions
        self.stats.add(bytes_offloaded=2 * keys.size * self.k.element_size())

    def free(self) -> None:
        """Release the pool."""
        self.stats.add(host_bytes=-self.nbytes())
        self.k = self._alloc(0)
        self.v = self._alloc(0)
        self.positions = self.positions[:0]
        self.used_pages = 0
