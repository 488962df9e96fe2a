"""The host tier: indexed KV of every request of one layer, cluster-contiguous, in fixed pages.

One pool per layer (``k``/``v`` [capacity_pages, page_size, D], all requests and KV heads),
as vLLM's paged KV is one pool per layer: a request's store holds extents of pages (one
per update block) and its mapping table addresses them by page number, so the batched
decode path reads every request's misses through one gather call. Every cluster starts on
a page boundary and occupies ``ceil(size / page_size)`` consecutive pages (the last one
padded), so a cluster is one contiguous host range and one run of the gather kernel.

**Preallocated, committed on use.** As vLLM sizes its KV cache once, a pool is allocated
once at the size it may ever need (``reserve_pages``: the runtime gives every layer twice its
share of the machine's memory, :func:`vllm_retro.vllm.runtime.pool_reserve_bytes`), so no
request's pages are ever copied to make room and no pool keeps a growth's slack. The pool
is a private anonymous mapping (``MAP_NORESERVE``: only address space is taken up front),
zero until written, and the OS commits its memory page by page as layouts write it; a
released extent's memory goes back to the OS (``MADV_DONTNEED``), so the pool holds the
live requests' pages and no more (:meth:`nbytes`). Extents freed by finished requests are
reused first-fit. Only a pool without a reservation (``reserve_pages`` 0: a store's
private pool, tests) or, unpinned, past it grows, geometrically, copying the used pages
into a new mapping.

On CUDA the pool is pinned so that the gather kernel reads it directly (unified
addressing). Pinning commits memory, so it follows the high-water mark: each time the used
pages pass the pinned prefix, the next :data:`PIN_CHUNK` bytes are registered with the
driver (``cudaHostRegister``). Pinned pages stay committed (locked pages cannot be given
back) until the pool is freed. A registered range must stay mapped until it is
unregistered: the driver keeps an unmapped range in its table, so the next mapping the
kernel puts at those addresses (a pool's, or torch's pinned allocator's) fails to register
("already registered", "resource already mapped"). So every registered range holds its
mapping, and only :meth:`free` unregisters, after the owner's ``fence`` (the device's
reads are done); the mapping goes once no view of it is left. Hence:

- a pinned pool with a reservation is registered in chunks of one mapping that is never
  replaced: a claim past the reservation fails (the runtime reserves every layer twice its
  share of the most host memory the budget admits, so admitted requests fit:
  :func:`vllm_retro.vllm.runtime.pool_reserve_bytes`, :mod:`vllm_retro.vllm.host_budget`);
- a pinned pool without one grows as above, and the pools it replaced stay mapped and
  registered (a reader may hold them) until :meth:`free`.

The pool also holds each row's absolute position, indexed like the rows (-1: padding).

Writers are the wave buffer's worker thread (layouts, growth) and, off it, :meth:`release`
(a finished request); a lock orders it and every claim against growth. Growth builds new arrays and
swaps them in whole, so a reader holding the old ones still reads every page laid out
before.
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading
from collections.abc import Callable

import numpy as np
import torch

from vllm_retro.buffer.stats import BufferStats
from vllm_retro.growth import grown

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0
"""Linux's ``MAP_NORESERVE`` (Python's ``mmap`` module names it only from 3.13)."""

PIN_CHUNK = 64 << 20
"""Bytes of each array (K, V) registered with the CUDA driver at a time."""

logger = logging.getLogger("vllm.retro.host_tier")


def bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's raw elements (same shape, an integer type of the same
    width), so rows can be copied with numpy whatever the dtype (numpy has no bfloat16).

    The buffer's worker thread moves bytes with numpy rather than torch: a torch CPU op run
    on a second thread starts a second OpenMP team, which then competes for the cores with
    the decode path (measured: ~1.7x slower decode steps on 2 cores).
    """
    return t.view(_BITS[t.element_size()]).numpy()


def anonymous_mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous read-write mapping of ``nbytes`` bytes, zero until written, whose
    memory the OS commits page by page on first write (``MAP_NORESERVE`` on Linux). It is
    unmapped when the object and every view of it are gone."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype,
               mapper: Callable[[int], mmap.mmap] = anonymous_mapping
               ) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zero tensor of ``shape`` whose memory the OS commits page by page on first write
    (a mapping of ``mapper``: :func:`anonymous_mapping`), and its mapping (None when
    empty). The tensor keeps the mapping alive; never ``close`` it while a view may be
    read."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype), None
    mm = mapper(nbytes)
    return torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape), mm


def cuda_register(ptr: int, nbytes: int) -> None:
    """Pin ``nbytes`` of host memory at ``ptr`` for the CUDA driver (portable, mapped: the
    device reads it at the same address under unified addressing)."""
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 3))
    if err != 0:
        raise RuntimeError(f"pinning {nbytes} bytes of the wave buffer's host pool failed "
                           f"(cudaHostRegister error {err})")


def cuda_unregister(ptr: int) -> None:
    """Unpin a range :func:`cuda_register` pinned at ``ptr``."""
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        raise RuntimeError(f"unpinning the wave buffer's host pool failed "
                           f"(cudaHostUnregister error {err})")


class HostTier:
    """Page pool of keys and values of one layer: ``k``/``v`` [capacity_pages, page_size, D],
    with a first-fit extent allocator."""

    def __init__(self, head_dim: int, page_size: int, dtype: torch.dtype, stats: BufferStats,
                 pin: bool = False, reserve_pages: int = 0,
                 pinner: tuple[Callable[[int, int], None], Callable[[int], None]] | None = None,
                 mapper: Callable[[int], mmap.mmap] = anonymous_mapping,
                 fence: Callable[[], None] | None = None):
        """``pin``: register the pool with the device's driver, for an owner serving a
        CUDA device (decided there: a pool read only by the CPU is never pinned).
        ``reserve_pages``: pages the pool is allocated with at its first claim (address
        space until written; 0: just what is claimed, growing by 1.5x). ``pinner``:
        (register, unregister) of host ranges for the device; default the CUDA driver's.
        ``mapper``: maps ``nbytes`` of zeroed host memory for the pool's arrays (tests pass
        one that watches the mappings' lifetimes). ``fence``: returns once no device work
        submitted so far can still read the pool (on CUDA the owner's device synchronize);
        called before ranges are unregistered (None: nothing reads the pool
        asynchronously)."""
        if reserve_pages < 0:
            raise ValueError(f"reserve_pages {reserve_pages}; accepted: >= 0")
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.stats = stats
        self.pin = pin
        self.reserve_pages = int(reserve_pages)
        self._register, self._unregister = pinner or (cuda_register, cuda_unregister)
        self._mapper = mapper
        self._fence = fence
        self.k = torch.zeros(0, page_size, head_dim, dtype=dtype)
        self.v = torch.zeros(0, page_size, head_dim, dtype=dtype)
        self.positions = torch.full((0,), -1, dtype=torch.int64)
        """[capacity_pages * page_size] absolute token position of each row (-1 = padding)."""
        self.used_pages = 0
        """High-water mark: pages below it are allocated or in :attr:`free_extents`."""
        self.free_extents: list[tuple[int, int]] = []
        """(first page, pages) of released extents below :attr:`used_pages`, by first page."""
        self.generation = 0
        """Pools replaced so far (a growth replaces ``k``, ``v`` and ``positions``)."""
        self._maps: list[mmap.mmap] = []
        """The mappings of the current ``k`` and ``v`` (released extents are discarded)."""
        self._pinned: list[tuple[int, mmap.mmap]] = []
        """Start of every range registered with the driver, current and replaced pools, and
        the mapping it lies in (held: it stays mapped until :meth:`free` unregisters it)."""
        self._pinned_bytes = 0
        """Prefix of the current ``k`` (and ``v``) registered, bytes."""
        self._retired_pinned = 0
        """Bytes still registered in pools a growth replaced (held until :meth:`free`)."""
        self._counted = 0
        """Bytes this pool has added to ``stats.host_bytes``."""
        self._stream: torch.cuda.Stream | None = None
        """The side stream blocks are copied into the pool on (:meth:`claim_rows`)."""
        self._lock = threading.Lock()

    @property
    def capacity_pages(self) -> int:
        """Pages allocated (address space: see the module docstring)."""
        return int(self.k.shape[0])

    @property
    def allocated_pages(self) -> int:
        """Pages held by requests' extents."""
        with self._lock:
            return self._allocated()

    def _allocated(self) -> int:
        return self.used_pages - sum(n for _, n in self.free_extents)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current pool's keys and values as token rows, [capacity_pages * page_size, D]
        each, taken together: a growth on the update worker replaces both, and two separate
        reads of ``k`` and ``v`` could straddle it (pools of two sizes)."""
        with self._lock:
            k, v = self.k, self.v
        return k.view(-1, self.head_dim), v.view(-1, self.head_dim)

    def nbytes(self) -> int:
        """Host bytes the pool holds: the requests' pages (a released extent's memory goes
        back to the OS); pinned, every registered byte (locked until :meth:`free`)."""
        return self._counted

    def page_nbytes(self) -> int:
        """Bytes of one page of keys and values."""
        return 2 * self._array_page_bytes()

    def _array_page_bytes(self) -> int:
        return self.page_size * self.head_dim * self.k.element_size()

    def _account(self) -> None:
        """Bring ``stats.host_bytes`` to :meth:`nbytes`'s figure (caller holds the lock)."""
        if self.pin:
            held = 2 * self._pinned_bytes + self._retired_pinned
        else:
            held = self._allocated() * self.page_nbytes()
        self.stats.add(host_bytes=held - self._counted)
        self._counted = held

    def reserve(self, pages: int, headroom: int = 0) -> int:
        """Claim ``pages`` consecutive pages (their block map and positions set to -1);
        returns the first. A released extent that fits is reused (first fit); else the claim
        goes at the high-water mark, and a pool without room grows (see :meth:`ensure_room`),
        to ``headroom`` pages beyond the claim if it was empty and has no reservation.
        Called from the update worker, so it copies with numpy (see :func:`bits`)."""
        with self._lock:
            start = self._claim(pages, headroom)
            self.positions.numpy()[start * self.page_size:(start + pages) * self.page_size] = -1
            self._account()
            return start

    def _claim(self, pages: int, headroom: int) -> int:
        """:meth:`reserve`'s claim (caller holds the lock)."""
        for i, (start, n) in enumerate(self.free_extents):
            if n >= pages:
                rest = (start + pages, n - pages)
                self.free_extents[i:i + 1] = [rest] if rest[1] else []
                break
        else:
            self._ensure_room(pages + (headroom if self.capacity_pages == 0 else 0))
            start = self.used_pages
            self._pin_upto(start + pages)
            self.used_pages = start + pages
        return start

    def claim_rows(self, k_rows: torch.Tensor, v_rows: torch.Tensor, positions: np.ndarray,
                   headroom: int = 0, ready: torch.cuda.Event | None = None) -> int:
        """Claim ``len(positions) / page_size`` consecutive pages (as :meth:`reserve`) and
        write a block laid out in page order into them: ``k_rows``/``v_rows`` [pages *
        page_size, D] of the pool's dtype, on any device (on CUDA ready once ``ready``, an
        event on the producing stream, has passed), and ``positions`` [pages * page_size]
        int64 (-1: padding). Returns the first page, once every byte has landed.

        A pool that is never replaced (pinned, with a reservation) is written outside the
        lock: one copy per array from the device straight into its registered pages (DMA,
        no staging buffer), on a side stream. Any other pool is written under the lock, so
        that a growth cannot copy the pool between the claim and the write. Called from the
        update worker (a CUDA copy starts no OpenMP team)."""
        pages, rem = divmod(len(positions), self.page_size)
        if rem or k_rows.shape != (len(positions), self.head_dim) or v_rows.shape != k_rows.shape:
            raise ValueError(f"a block of {tuple(k_rows.shape)} keys, {tuple(v_rows.shape)} "
                             f"values and {len(positions)} positions; accepted: whole pages "
                             f"of {self.page_size} rows of {self.head_dim} for each")
        error: BaseException | None = None
        with self._lock:
            start = self._claim(pages, headroom)
            rows = slice(start * self.page_size, (start + pages) * self.page_size)
            self.positions.numpy()[rows] = positions
            dst_k = self.k.view(-1, self.head_dim)[rows]
            dst_v = self.v.view(-1, self.head_dim)[rows]
            self._account()
            moving = not self._fixed()
            if moving:
                try:
                    self._copy_in(dst_k, dst_v, k_rows, v_rows, ready)
                except BaseException as exc:
                    error = exc
        if not moving:
            try:
                self._copy_in(dst_k, dst_v, k_rows, v_rows, ready)
            except BaseException as exc:
                error = exc
        if error is not None:  # nobody was told of the extent: it goes back
            self.release(start, pages)
            raise error
        self.stats.add(bytes_offloaded=2 * k_rows.numel() * self.k.element_size())
        return start

    def _copy_in(self, dst_k: torch.Tensor, dst_v: torch.Tensor, k_rows: torch.Tensor,
                 v_rows: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Copy device (or CPU) rows into the pool's rows ``dst_k``/``dst_v``, done when
        this returns."""
        if not k_rows.is_cuda:
            bits(dst_k)[:] = bits(k_rows.contiguous())
            bits(dst_v)[:] = bits(v_rows.contiguous())
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=k_rows.device)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            dst_k.copy_(k_rows, non_blocking=True)
            dst_v.copy_(v_rows, non_blocking=True)
        self._stream.synchronize()

    def release(self, start: int, pages: int) -> None:
        """Return the extent of ``pages`` pages at ``start`` (its rows become padding, its
        memory the OS's unless pinned); merged with its free
        neighbours, and given back to the high-water mark when it ends there."""
        if pages <= 0:
            return
        with self._lock:
            self.positions.numpy()[start * self.page_size:(start + pages) * self.page_size] = -1
            if not self.pin:
                self._discard(start, pages)
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
            self._account()

    def _discard(self, start: int, pages: int) -> None:
        """Give the OS pages of the extent's keys and values back (they read as zeros when
        next written); only whole OS pages inside the extent."""
        size = self._array_page_bytes()
        lo = -(-start * size // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (start + pages) * size // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            for mm in self._maps:
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _pin_upto(self, pages: int) -> None:
        """Register the current pool's keys and values up to page ``pages`` (rounded up to
        :data:`PIN_CHUNK` bytes, at most the pool) with the driver."""
        if not self.pin:
            return
        total = self.capacity_pages * self._array_page_bytes()
        target = min(total, -(-pages * self._array_page_bytes() // PIN_CHUNK) * PIN_CHUNK)
        if target > self._pinned_bytes:
            mk, mv = self._maps
            self._pin_range([(self.k, mk), (self.v, mv)], self._pinned_bytes, target)
            self._pinned_bytes = target

    def _pin_range(self, arrays: list[tuple[torch.Tensor, mmap.mmap]], lo: int, hi: int
                   ) -> None:
        """Register bytes ``lo:hi`` of each array (with the mapping it lies in), all or
        none: when one fails, those just registered are unregistered again (no reader was
        given them) and the error raised."""
        done: list[tuple[int, mmap.mmap]] = []
        try:
            for t, mm in arrays:
                self._register(t.data_ptr() + lo, hi - lo)
                done.append((t.data_ptr() + lo, mm))
        except BaseException:
            for ptr, _ in done:
                self._unregister(ptr)
            raise
        self._pinned += done

    def _fixed(self) -> bool:
        """The pool is never replaced: pinned and mapped at its reservation."""
        return self.pin and self.reserve_pages > 0 and self.capacity_pages > 0

    def ensure_room(self, pages: int) -> bool:
        """Grow the pool unless ``pages`` more fit past the high-water mark; True when it
        grew. The grown pool replaces the old one whole, after the copy, so a reader holding
        the old pool still reads every page laid out before. A pool that is never replaced
        (pinned, with a reservation) is left as it is: a claim that does not fit then fails
        (:meth:`reserve`)."""
        with self._lock:
            return False if self._fixed() else self._ensure_room(pages)

    def _ensure_room(self, pages: int) -> bool:
        need = self.used_pages + pages
        cap = self.capacity_pages
        if need <= cap:
            return False
        if self._fixed():
            raise RuntimeError(
                f"a layer's pinned host pool is full: {pages} more pages do not fit "
                f"past page {self.used_pages} of its reservation of {cap} pages "
                f"({cap * self.page_nbytes() / 2**30:.2f} GiB); a pinned pool is never "
                "remapped (the device reads it by address), so its requests must fit the "
                "reservation (WaveBufferManager(pool_reserve_bytes=...), kept by the host "
                "budget's admission)")
        if cap == 0 and self.reserve_pages:
            size = max(need, self.reserve_pages)
        else:
            size = grown(need, cap)
            if self.reserve_pages:
                logger.warning("retro: a layer's host pool outgrew its reservation of %d "
                               "pages; growing it to %d pages (copying %d)", cap, size,
                               self.used_pages)
        try:
            k, mk = lazy_zeros((size, self.page_size, self.head_dim), self.dtype, self._mapper)
            v, mv = lazy_zeros((size, self.page_size, self.head_dim), self.dtype, self._mapper)
        except OSError as exc:  # the address space asked for is not there
            if size == need:
                raise
            logger.warning("retro: could not map %d host pages for a layer (%s); mapping "
                           "%d and growing later", size, exc, need)
            size = need
            k, mk = lazy_zeros((size, self.page_size, self.head_dim), self.dtype, self._mapper)
            v, mv = lazy_zeros((size, self.page_size, self.head_dim), self.dtype, self._mapper)
        used = self.used_pages
        pinned = 0
        if self.pin:
            pinned = min(size * self._array_page_bytes(),
                         -(-used * self._array_page_bytes() // PIN_CHUNK) * PIN_CHUNK)
            if pinned:
                self._pin_range([(k, mk), (v, mv)], 0, pinned)
        bits(k)[:used] = bits(self.k)[:used]
        bits(v)[:used] = bits(self.v)[:used]
        positions, _ = lazy_zeros((size * self.page_size,), torch.int64, self._mapper)
        positions[: used * self.page_size] = self.positions[: used * self.page_size]
        self.k, self.v, self.positions = k, v, positions
        self._maps = [mk, mv]
        self._retired_pinned += 2 * self._pinned_bytes
        self._pinned_bytes = pinned
        self.generation += 1
        self._account()
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
        """Release the pool (no store is left): its ranges unregistered once the device's
        reads are done (``fence``), its mappings unmapped once no view of them is left."""
        with self._lock:
            pinned, self._pinned = self._pinned, []
            if pinned and self._fence is not None:
                self._fence()
            for ptr, _ in pinned:
                try:
                    self._unregister(ptr)
                except RuntimeError as exc:  # the memory goes with the mapping regardless
                    logger.error("retro: %s", exc)
            # fresh empty arrays: a slice would keep the mappings alive
            self.k = torch.zeros(0, self.page_size, self.head_dim, dtype=self.dtype)
            self.v = torch.zeros(0, self.page_size, self.head_dim, dtype=self.dtype)
            self.positions = torch.full((0,), -1, dtype=torch.int64)
            self._maps = []
            self._pinned_bytes = self._retired_pinned = 0
            self.used_pages = 0
            self.free_extents = []
            self._account()
