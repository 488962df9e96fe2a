"""The steady zone of a layer's wave indexes in one pool: per request a slot, per slot the
sinks and a ring buffer of the local window.

Layout (as vLLM's paged KV and gpt-fast's in-place KV buffers): one K and one V tensor per
layer, ``[slots, sink_cap + ring, H, D]``, token-major:

- rows ``[0, s)`` of a slot: its sinks (``s = min(sink_tokens, context)``);
- rows ``[sink_cap, sink_cap + ring)``: the window as a ring. Token ``t >= s`` of the
  request (absolute position) lives at ring row ``(t - s) % ring``, so its place depends on
  the request's position alone, the same in every layer, and an update block leaving the
  window moves nothing (the window's start advances).

``ring`` is ``local_window + 2 * update_segment``: a due update block waits, exact in the
window, while it is clustered, and new tokens keep coming (:meth:`WaveIndex.append` keeps the
window within the ring). Token-major rows make one step's new keys of every row of the batch
one write (:meth:`SteadyPool.write`: one call on the CPU, one ``index_put`` per K and V
elsewhere, whatever the batch), and
each slot's per-head view is a strided ``[H, n, D]`` view that the kernels read in place.

A standalone index (the library API) has a pool of its own with one slot. In serving, each
retro layer has one pool and a request has the same slot in every layer
(:class:`SlotTable`); an index built on the builder thread fills a private pool and is
adopted into its layer's pool on the engine's thread (:meth:`SteadyPool.adopt`), so the
shared pool only changes between forwards.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from vllm_retro.growth import grown
from vllm_retro.index.store import fill_steady
from vllm_retro.kernels import cpu_decode, cpu_ext


def ring_size(local_window: int, update_segment: int) -> int:
    """Ring rows of a slot's window: the local window plus room for one update block being
    clustered and one block of tokens arriving meanwhile."""
    return local_window + 2 * update_segment


def _indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index: "cuda" is the current CUDA device, as a tensor's device
    reads ("cuda:0"), so a pool made for "cuda" fits indexes built there."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class SteadyPool:
    """The steady zone of up to :attr:`num_slots` requests of one layer (see the module
    docstring). ``sink_cap`` sink rows and ``ring`` window rows per slot; ``H`` heads of
    ``D`` dims; grown by >= 1.5x when a slot beyond the pool is asked for."""

    def __init__(self, num_heads: int, head_dim: int, sink_cap: int, ring: int,
                 dtype: torch.dtype, device: torch.device, slots: int = 1,
                 zeroed: bool = False):
        if ring < 1:
            raise ValueError(f"steady pool: ring={ring}; accepted: at least 1 row")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.sink_cap = sink_cap
        self.ring = ring
        self.dtype = dtype
        self.device = _indexed(device)
        self.zeroed = zeroed
        """Rows never written read as zeros (a shared pool, whose rows past a slot's steady
        zone a batched fill may copy: finite, masked by the kernels; a private pool's
        readers read only written rows)."""
        self.k = self._empty(slots)
        self.v = self._empty(slots)
        self.generation = 0
        """Bumped whenever :attr:`k` / :attr:`v` are replaced (growth, release): views read
        at one generation stay valid until the next."""
        self._lock = threading.Lock()

    def _empty(self, slots: int) -> torch.Tensor:
        make = torch.zeros if self.zeroed else torch.empty
        return make(slots, self.sink_cap + self.ring, self.num_heads, self.head_dim,
                    dtype=self.dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        """Slots the pool holds now."""
        return int(self.k.shape[0])

    def fits(self, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
             sink_cap: int, ring: int) -> bool:
        """True when an index of this shape can live in the pool."""
        return (num_heads, head_dim, dtype, _indexed(device), sink_cap, ring) == (
            self.num_heads, self.head_dim, self.dtype, self.device, self.sink_cap, self.ring)

    def ensure(self, slots: int) -> None:
        """Hold at least ``slots`` slots (contents kept; a growth replaces the tensors)."""
        with self._lock:
            if slots <= self.num_slots:
                return
            cap = grown(slots, self.num_slots)
            k, v = self._empty(cap), self._empty(cap)
            k[:self.num_slots] = self.k
            v[:self.num_slots] = self.v
            self.k, self.v = k, v
            self.generation += 1

    def release(self) -> None:
        """Drop the memory (no slot is in use); the next :meth:`ensure` allocates again."""
        with self._lock:
            self.k, self.v = self._empty(0), self._empty(0)
            self.generation += 1

    def nbytes_per_slot(self) -> int:
        """Bytes of one slot (K and V, sinks and ring)."""
        return 2 * (self.sink_cap + self.ring) * self.num_heads * self.head_dim * \
            self.k.element_size()

    def nbytes(self) -> int:
        """Bytes held (every slot)."""
        return self.num_slots * self.nbytes_per_slot()

    # ------------------------------------------------------------------ rows
    def ring_row(self, sinks: int, position: int) -> int:
        """Pool row of the window token at absolute ``position`` of a request with ``sinks``
        sinks."""
        return self.sink_cap + (position - sinks) % self.ring

    def write(self, slots: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """``k[slots[i], rows[i]] = keys[i]`` (and values) for every i, for a whole batch at
        once: on the CPU one call of the extension (:func:`cpu_decode.steady_write`),
        elsewhere one ``index_put`` per tensor. slots, rows: [B] int64 on the pool's device;
        keys, values: [B, H, D]."""
        if (self.device.type == "cpu" and keys.dtype == self.dtype
                and values.dtype == self.dtype and cpu_ext.available()):
            cpu_decode.steady_write(self.k, self.v, slots, rows, keys, values)
            return
        self.k.index_put_((slots, rows), keys.to(self.dtype))
        self.v.index_put_((slots, rows), values.to(self.dtype))

    def write_rows(self, slot: int, sinks: int, first: int, keys: torch.Tensor,
                   values: torch.Tensor) -> None:
        """Write tokens at absolute positions ``first ..`` (keys, values [H, n, D], n at most
        :attr:`ring`) into ``slot``'s ring (a request's own append, e.g. a catch-up)."""
        n = keys.shape[1]
        start = (first - sinks) % self.ring
        head = min(n, self.ring - start)
        base = self.sink_cap
        self.k[slot, base + start:base + start + head] = keys[:, :head].transpose(0, 1)
        self.v[slot, base + start:base + start + head] = values[:, :head].transpose(0, 1)
        if head < n:  # wrapped
            self.k[slot, base:base + n - head] = keys[:, head:].transpose(0, 1)
            self.v[slot, base:base + n - head] = values[:, head:].transpose(0, 1)

    def write_sinks(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Set ``slot``'s sinks (keys, values [H, s, D], s at most :attr:`sink_cap`)."""
        s = keys.shape[1]
        self.k[slot, :s] = keys.transpose(0, 1)
        self.v[slot, :s] = values.transpose(0, 1)

    def sink_view(self, slot: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``slot``'s sinks as [H, sinks, D] views (strided, D contiguous)."""
        return (self.k[slot, :sinks].transpose(0, 1), self.v[slot, :sinks].transpose(0, 1))

    def ring_view(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``slot``'s whole ring as [H, ring, D] views (strided, D contiguous)."""
        base = self.sink_cap
        return (self.k[slot, base:].transpose(0, 1), self.v[slot, base:].transpose(0, 1))

    def window_parts(self, slot: int, start: int, n: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``n`` window tokens from ring row ``start`` on, in order, as one or two
        (keys, values) [H, n_i, D] views (two when they wrap around the ring)."""
        rk, rv = self.ring_view(slot)
        head = min(n, self.ring - start)
        parts = [(rk[:, start:start + head], rv[:, start:start + head])]
        if head < n:
            parts.append((rk[:, :n - head], rv[:, :n - head]))
        return parts

    def copy_slot(self, src: SteadyPool, src_slot: int, dst_slot: int, sinks: int,
                  start: int, n: int) -> None:
        """Copy the valid rows of ``src``'s slot (its ``sinks`` sinks, ``n`` window rows
        from ring row ``start``) into this pool's ``dst_slot`` at the same rows."""
        self.k[dst_slot, :sinks] = src.k[src_slot, :sinks]
        self.v[dst_slot, :sinks] = src.v[src_slot, :sinks]
        base = self.sink_cap
        head = min(n, self.ring - start)
        for lo, m in ((start, head), (0, n - head)):
            if m > 0:
                self.k[dst_slot, base + lo:base + lo + m] = src.k[src_slot, base + lo:base + lo + m]
                self.v[dst_slot, base + lo:base + lo + m] = src.v[src_slot, base + lo:base + lo + m]


def fill_steady_batch(indexes: Sequence[Any], exec_k: torch.Tensor, exec_v: torch.Tensor
                      ) -> list[int]:
    """Copy each index's steady zone (sinks, then window) to the front of its rows of an
    execution buffer (index b owns rows ``b * H .. (b + 1) * H`` of exec_k / exec_v,
    [B * H, T_cap, D]); returns each index's steady-zone length. When the indexes share one
    (zero-filled) pool it is one gather per K and V for the batch: rows past an index's
    own length up to the batch's longest then hold other rows of its slot (finite; the
    caller's later writes or the kernels' lengths make them irrelevant). Else a copy per
    piece per index."""
    counts = [i.num_sinks + i.win_len for i in indexes]
    pool = indexes[0].steady if indexes else None
    b, t = len(indexes), max(counts, default=0)
    if b == 0 or t == 0:
        return counts
    h = exec_k.shape[0] // b
    if not (pool.zeroed and all(i.steady is pool for i in indexes)):
        for j, index in enumerate(indexes):
            rows = slice(j * h, (j + 1) * h)
            fill_steady(index.steady_parts(), exec_k[rows], exec_v[rows])
        return counts
    dev = pool.device
    meta = torch.tensor([[i.slot, i.num_sinks, i.ring_start] for i in indexes]).to(dev)
    slot, sinks, first = meta[:, 0:1], meta[:, 1:2], meta[:, 2:3]
    j = torch.arange(t, device=dev)[None, :]
    rows = torch.where(j < sinks, j, pool.sink_cap + (first + j - sinks) % pool.ring)
    for src, dst in ((pool.k, exec_k), (pool.v, exec_v)):
        # [B, t, H, D] -> the front of each index's [H, T_cap, D] rows
        dst.view(b, h, dst.shape[1], dst.shape[2])[:, :, :t] = src[slot, rows].transpose(1, 2)
    return counts


class SlotTable:
    """Slot numbers of live requests (the same slot in every layer's pool): the lowest free
    one is handed out, a freed one is reused."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 0

    def get(self, request_id: str) -> int:
        """``request_id``'s slot, assigned on first use."""
        slot = self._slots.get(request_id)
        if slot is None:
            if self._free:
                self._free.sort()
                slot = self._free.pop(0)
            else:
                slot, self._next = self._next, self._next + 1
            self._slots[request_id] = slot
        return slot

    def find(self, request_id: str) -> int | None:
        """``request_id``'s slot, or None."""
        return self._slots.get(request_id)

    def release(self, request_id: str) -> int | None:
        """Give ``request_id``'s slot back; returns it (None if it had none)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        if not self._slots:
            self._free, self._next = [], 0
        return slot

    @property
    def high_water(self) -> int:
        """One past the highest slot handed out since the table was last empty."""
        return self._next

    def __len__(self) -> int:
        return len(self._slots)
