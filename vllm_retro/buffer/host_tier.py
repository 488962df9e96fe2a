"""The host tier: indexed KV of every request of one layer, cluster-contiguous, in fixed pages.

One pool per layer (``k``/``v`` [capacity_pages, page_size, D], all requests and KV heads),
as vLLM's paged KV is one pool per layer: a request's store holds extents of pages (one
per update block) and its mapping table addresses them by page number, so the batched
decode path reads every request's misses through one gather call. Every cluster starts on
a page boundary and occupies ``ceil(size / page_size)`` consecutive pages (the last one
padded), so a cluster is one contiguous host range and a page is the unit of the device
block cache.

Extents freed by finished requests are reused first-fit; the pool grows geometrically
(copying the used pages) only when no free extent fits. The pool also holds the one record
of which device block caches each page (``page_block``), since it is indexed like the
pages. It is pinned when CUDA is present, so the gather kernel reads it directly.

Writers are the wave buffer's worker thread (layouts, growth) and :meth:`release` (a
finished request); a lock orders allocation against release. Growth builds new arrays and
swaps them in whole, so a reader holding the old ones still reads every page laid out
before.
"""

from __future__ import annotations

import threading

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
    """Page pool of keys and values of one layer: ``k``/``v`` [capacity_pages, page_size, D],
    with a first-fit extent allocator."""

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
        self.page_block = np.zeros(0, dtype=np.int64)
        """[capacity_pages] device block caching each page (-1: not cached)."""
        self.used_pages = 0
        """High-water mark: pages below it are allocated or in :attr:`free_extents`."""
        self.free_extents: list[tuple[int, int]] = []
        """(first page, pages) of released extents below :attr:`used_pages`, by first page."""
        self.generation = 0
        """Pools replaced so far (a growth replaces ``k``, ``v`` and ``positions``)."""
        self._lock = threading.Lock()

    def _alloc(self, pages: int) -> torch.Tensor:
        return torch.zeros(pages, self.page_size, self.head_dim, dtype=self.dtype,
                           pin_memory=self.pin)

    @property
    def capacity_pages(self) -> int:
        """Pages allocated."""
        return int(self.k.shape[0])

    @property
    def allocated_pages(self) -> int:
        """Pages held by requests' extents."""
        with self._lock:
            return self.used_pages - sum(n for _, n in self.free_extents)

    def nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return 2 * self.k.numel() * self.k.element_size()

    def page_nbytes(self) -> int:
        """Bytes of one page of keys and values."""
        return 2 * self.page_size * self.head_dim * self.k.element_size()

    def reserve(self, pages: int, headroom: int = 0) -> int:
        """Claim ``pages`` consecutive pages; returns the first. A released extent that fits
        is reused (first fit); else the claim goes at the high-water mark and the pool grows
        when full (see :meth:`ensure_room`), to ``headroom`` pages beyond the claim if it was
        empty (a first allocation copies nothing, so the room for the next block is free
        to take now). Called from the update worker, so it copies with numpy (see
        :func:`bits`)."""
        with self._lock:
            for i, (start, n) in enumerate(self.free_extents):
                if n >= pages:
                    rest = (start + pages, n - pages)
                    self.free_extents[i:i + 1] = [rest] if rest[1] else []
                    return start
            self._ensure_room(pages + (headroom if self.capacity_pages == 0 else 0))
            start = self.used_pages
            self.used_pages = start + pages
            return start

    def release(self, start: int, pages: int) -> None:
        """Return the extent of ``pages`` pages at ``start`` (its rows become padding and its
        pages uncached); merged with its free neighbours, and given back to the high-water
        mark when it ends there."""
        if pages <= 0:
            return
        with self._lock:
            self.page_block[start:start + pages] = -1
            self.positions.numpy()[start * self.page_size:(start + pages) * self.page_size] = -1
            ext = sorted([*self.free_extents, (start, pages)])
            merged: list[tuple[int, int]] = []
            for s, n in ext:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            if merged and merged[-1][0] + merged[-1][1] == self.used_pages:
                self.used_pages = merged.pop()[0]
            self.free_extents = merged

    def ensure_room(self, pages: int) -> bool:
        """Grow the pool (by >= 1.5x, copying the used pages) unless ``pages`` more fit past
        the high-water mark; True when it grew. The grown pool replaces the old one whole,
        after the copy, so a reader holding the old pool still reads every page laid out
        before."""
        with self._lock:
            return self._ensure_room(pages)

    def _ensure_room(self, pages: int) -> bool:
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
        block = np.full(cap, -1, dtype=np.int64)
        block[: self.page_block.size] = self.page_block
        self.page_block = block
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
        with self._lock:
            self.stats.add(host_bytes=-self.nbytes())
            self.k = self._alloc(0)
            self.v = self._alloc(0)
            self.positions = self.positions[:0]
            self.page_block = self.page_block[:0]
            self.used_pages = 0
            self.free_extents = []
