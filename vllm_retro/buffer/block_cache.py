"""The device block cache of one layer: page-sized blocks shared by every request and head.

One pool per layer (``k``/``v`` [num_blocks, page_size, D]) with one free list, so the
batched decode path copies every request's admissions with one call. Each (request, KV
head) has a budget of blocks (its store's ``capacity``); the pool holds at least the sum of
the live budgets (:meth:`reserve`), so a head under its budget always finds a free block. A
cluster is cached whole or not at all; which clusters stay is the policy's decision (see
:mod:`vllm_retro.buffer.policy`).

The free list is a stack of block ids in one int64 array (:attr:`free_stack`, the first
:attr:`n_free` entries free, taken from the top), so the update worker's compiled cache
update takes and gives blocks in place. It is taken from and refilled by the update worker
(admissions, evictions) and by the decode thread (growth, a finished request's blocks),
under one lock (:attr:`lock`). Growth appends blocks, so block ids stay valid.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from vllm_retro import kernels
from vllm_retro.buffer.stats import BufferStats


class DeviceBlockPool:
    """Block pool plus one free list. Block ids are rows of ``k``/``v``."""

    def __init__(self, head_dim: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, stats: BufferStats):
        self.head_dim = head_dim
        self.page_size = page_size
        self.stats = stats
        self.k = torch.zeros(0, page_size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.free_stack = np.zeros(0, dtype=np.int64)
        """[num_blocks] int64: the free block ids are its first :attr:`n_free` entries."""
        self.n_free = np.zeros(1, dtype=np.int64)
        """[1] int64 (an array, so compiled code updates it in place)."""
        self.reserved = 0
        """Sum of the live budgets, in blocks (at most :attr:`num_blocks`)."""
        self.lock = threading.Lock()
        """Orders every change of the free list and the pool's arrays."""

    @property
    def free_blocks(self) -> list[int]:
        """The free block ids, bottom of the stack first (a copy)."""
        with self.lock:
            return self.free_stack[:int(self.n_free[0])].tolist()

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return int(self.k.shape[0])

    def nbytes(self) -> int:
        """Device bytes of the pool."""
        return 2 * self.k.numel() * self.k.element_size()

    def reserve(self, blocks: int) -> None:
        """Add ``blocks`` to the budgets the pool must hold, growing it (by >= 1.25x,
        reallocated, contents kept) when they exceed it. Decode thread only."""
        if blocks <= 0:
            return
        with self.lock:
            self.reserved += blocks
            short = self.reserved - self.num_blocks
            if short <= 0:
                return
            grow = max(short, self.num_blocks // 4)
            first = self.num_blocks
            before = self.nbytes()
            extra = torch.zeros(grow, self.page_size, self.head_dim, dtype=self.k.dtype,
                                device=self.k.device)
            self.k = torch.cat([self.k, extra])
            self.v = torch.cat([self.v, extra])
            stack = np.zeros(first + grow, dtype=np.int64)
            n = int(self.n_free[0])
            stack[:n] = self.free_stack[:n]
            stack[n:n + grow] = np.arange(first, first + grow)
            self.free_stack = stack
            self.n_free[0] = n + grow
        self.stats.add(device_bytes=self.nbytes() - before)

    def write_runs(self, src_k: torch.Tensor, src_v: torch.Tensor, host_k: torch.Tensor,
                   host_v: torch.Tensor, runs: np.ndarray, backend: str) -> None:
        """Copy ``runs`` ([N, 3] int64, :mod:`vllm_retro.kernels.gather`; destinations are
        flat pool rows, block * page_size + slot) in from ``src_*`` ([rows, D], counts > 0)
        or ``host_*`` ([rows, D], counts < 0): one gather call. Under the lock, so a growth
        on another thread (a background index build) cannot copy the pool while the rows
        land in the old one."""
        if runs.shape[0] == 0:
            return
        d = self.head_dim
        with self.lock:
            kernels.gather_runs(self.k.view(-1, d), self.v.view(-1, d), src_k, src_v, host_k,
                                host_v, torch.from_numpy(runs), backend=backend)

    def unreserve(self, blocks: int) -> None:
        """A budget of ``blocks`` is gone (its blocks were given back first)."""
        with self.lock:
            self.reserved -= blocks

    def take(self, n: int) -> np.ndarray:
        """``n`` free blocks ([n] int64), off the free list."""
        with self.lock:
            free = int(self.n_free[0])
            if n > free:
                raise RuntimeError(f"device block pool: {n} blocks asked, "
                                   f"{free} free (budgets overcommitted)")
            self.n_free[0] = free - n
            return self.free_stack[free - n:free].copy()

    def give(self, blocks: np.ndarray) -> None:
        """Put ``blocks`` ([n] ids) back on the free list."""
        blocks = np.asarray(blocks, dtype=np.int64)
        with self.lock:
            free = int(self.n_free[0])
            if free + blocks.size > self.free_stack.size:
                raise RuntimeError(f"device block pool: {blocks.size} blocks given back, "
                                   f"{free} of {self.free_stack.size} already free")
            self.free_stack[free:free + blocks.size] = blocks
            self.n_free[0] = free + blocks.size

    def free(self) -> None:
        """Release the pool."""
        with self.lock:
            self.stats.add(device_bytes=-self.nbytes())
            self.k = self.k[:0].clone()
            self.v = self.v[:0].clone()
            self.free_stack = np.zeros(0, dtype=np.int64)
            self.n_free[0] = 0
            self.reserved = 0
