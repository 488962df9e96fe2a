"""A layer's meta rows in one preallocated pool: every index's per-cluster rows (centroids,
value sums, sizes, spreads, deviates; a baseline's sizes or page bounds) in an extent of it.

Layout: per field one tensor ``[H, capacity, *trail]``; an index holds the rows
``[start, start + length)`` of every field (its **extent**), filled from ``start`` up to the
field's count. The views an index reads, ``[H, n, *trail]``, are strided views of the pool
(head stride ``capacity``), as its own growing buffers were before.

- :class:`ExtentTable` hands out and takes back extents: integers only, no tensors (as
  nano-vllm's block manager hands out blocks);
- :class:`MetaPool` holds the tensors and moves rows when an extent grows, the pool grows
  (>= 1.5x, :func:`~vllm_retro.growth.grown`) or shrinks (when a quarter or less is used);
- :class:`MetaRows` is one index's rows: its extent, the fill count of each field, and
  views of them.

A standalone index (the library API, the index builder's thread) has a pool of its own; in
serving, each attention layer has one pool (its
:class:`~vllm_retro.vllm.layer_state.LayerState`'s), and an index built elsewhere is moved in
when the layer takes it over (:meth:`MetaRows.adopt`, one copy per field), on the engine's
thread, between forwards.

Whenever rows move (the pool resized or compacted, an extent moved) :attr:`MetaPool.generation`
counts up: views read before are stale then (they still hold the right values, but of the old
storage, which they keep alive), and caches holding views key on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from vllm_retro.growth import grown

FieldSpec = tuple[tuple[int, ...], torch.dtype]
"""A field's trailing shape after ``[H, rows]`` and its dtype."""


class ExtentTable:
    """Extents ``[start, start + length)`` of an arena of :attr:`capacity` rows, by handle.

    :meth:`alloc` places an extent first fit (the lowest start with room); :meth:`free`
    takes it back; :meth:`packed` lays the live extents out from row 0 in their order (a
    compaction's plan). Integers only."""

    def __init__(self, capacity: int = 0):
        if capacity < 0:
            raise ValueError(f"capacity {capacity}; accepted: >= 0")
        self.capacity = capacity
        self._extents: dict[int, tuple[int, int]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._extents)

    @property
    def used(self) -> int:
        """Rows held by live extents."""
        return sum(length for _, length in self._extents.values())

    def start(self, handle: int) -> int:
        return self._extents[handle][0]

    def length(self, handle: int) -> int:
        return self._extents[handle][1]

    def extents(self) -> dict[int, tuple[int, int]]:
        """handle -> (start, length) of every live extent (a copy)."""
        return dict(self._extents)

    def _check(self, length: int) -> None:
        if length < 1:
            raise ValueError(f"extent length {length}; accepted: >= 1")

    def room_after(self, handle: int) -> int:
        """Free rows right after the extent (up to the next extent or the arena's end)."""
        start, length = self._extents[handle]
        end = start + length
        nxt = min((s for s, _ in self._extents.values() if s >= end), default=self.capacity)
        return nxt - end

    def alloc(self, length: int) -> int | None:
        """A new extent of ``length`` rows at the lowest start with room; its handle, or None
        when no gap is long enough."""
        self._check(length)
        at = 0
        for start, n in sorted(self._extents.values()):
            if start - at >= length:
                break
            at = max(at, start + n)
        if self.capacity - at < length:
            # the loop ends past the last extent only when no gap before it was long enough
            return None
        handle = self._next
        self._next += 1
        self._extents[handle] = (at, length)
        return handle

    def resize(self, handle: int, length: int) -> None:
        """Change the extent's length in place (it must fit before the next extent)."""
        self._check(length)
        start, old = self._extents[handle]
        if length > old + self.room_after(handle):
            raise ValueError(f"extent {handle} cannot grow to {length} rows in place")
        self._extents[handle] = (start, length)

    def free(self, handle: int) -> None:
        del self._extents[handle]

    def transfer(self, handle: int, new: int) -> None:
        """``handle`` takes over extent ``new`` (whose handle is gone after); its own rows
        are free."""
        self._extents[handle] = self._extents.pop(new)

    def packed(self, capacity: int, last: int | None = None) -> dict[int, int]:
        """Handle -> new start, with the live extents laid out from row 0 in start order
        (``last``, when given, after all others) in an arena of ``capacity`` rows, which
        then holds them all; applied to the table."""
        order = sorted(self._extents, key=lambda h: (h == last, self._extents[h][0]))
        need = sum(self._extents[h][1] for h in order)
        if need > capacity:
            raise ValueError(f"capacity {capacity}; accepted: >= {need} (the rows held)")
        out, at = {}, 0
        for h in order:
            out[h] = at
            at += self._extents[h][1]
        self._extents = {h: (out[h], self._extents[h][1]) for h in order}
        self.capacity = capacity
        return out


class MetaPool:
    """The meta rows of one layer's indexes (see the module docstring): ``fields`` name ->
    (trailing shape, dtype), ``num_heads`` heads, on ``device``."""

    def __init__(self, num_heads: int, fields: Mapping[str, FieldSpec],
                 device: torch.device | str):
        if num_heads < 1 or not fields:
            raise ValueError(f"num_heads {num_heads}, fields {list(fields)}; accepted: "
                             ">= 1 head and at least one field")
        self.num_heads = num_heads
        self.fields = {name: (tuple(trail), dtype) for name, (trail, dtype) in fields.items()}
        self.device = torch.device(device)
        self.table = ExtentTable()
        self.tensors = self._empty(0)
        """Field name -> [H, capacity, *trail]."""
        self.generation = 0
        """Counts moves of rows (resize, compaction, extent moved): see the module docstring."""
        self.storage = 0
        """Counts replacements of the tensors (resize, compaction, clear): what reads them by
        address (a CUDA graph) is stale once it moves."""

    def _empty(self, capacity: int) -> dict[str, torch.Tensor]:
        return {name: torch.empty(self.num_heads, capacity, *trail, dtype=dtype,
                                  device=self.device)
                for name, (trail, dtype) in self.fields.items()}

    @property
    def capacity(self) -> int:
        return self.table.capacity

    def fits(self, num_heads: int, fields: Mapping[str, FieldSpec],
             device: torch.device | str) -> bool:
        """Whether an index of this layout can hold its rows here."""
        same = {name: (tuple(trail), dtype) for name, (trail, dtype) in fields.items()}
        return (num_heads == self.num_heads and same == self.fields
                and torch.device(device) == self.device)

    def row_bytes(self) -> int:
        """Bytes of one row of every field (all heads)."""
        return sum(self.num_heads * dtype.itemsize * math.prod(trail)
                   for trail, dtype in self.fields.values())

    def nbytes(self) -> int:
        """Bytes held (the whole capacity)."""
        return self.capacity * self.row_bytes()

    def reserve(self, length: int) -> int:
        """A new extent of ``length`` rows (the pool grows >= 1.5x when no gap fits); its
        handle."""
        handle = self.table.alloc(length)
        if handle is None:
            used = self.table.used
            cap = self.capacity if used + length <= self.capacity // 2 else \
                grown(used + length, self.capacity)
            self._relayout(cap)  # compacted: the free rows are one run at the end
            handle = self.table.alloc(length)
            assert handle is not None
        return handle

    def regrow(self, handle: int, length: int) -> None:
        """Make the extent ``length`` rows long, keeping its rows: in place when the rows
        after it are free, else moved to a gap, else with the pool grown (>= 1.5x) and
        compacted, the extent last."""
        t = self.table
        old_len = t.length(handle)
        if length <= old_len + t.room_after(handle):
            t.resize(handle, length)
            return
        new = t.alloc(length)
        if new is not None:
            src, dst = t.start(handle), t.start(new)
            for x in self.tensors.values():
                x[:, dst:dst + old_len] = x[:, src:src + old_len]
            t.transfer(handle, new)
            self.generation += 1
            return
        self._relayout(grown(t.used - old_len + length, self.capacity), last=handle)
        t.resize(handle, length)

    def release(self, handle: int) -> None:
        """Take the extent back; the pool shrinks to twice what is held when a quarter or
        less of it is (to nothing when nothing is)."""
        self.table.free(handle)
        used = self.table.used
        if self.capacity and 4 * used <= self.capacity:
            self._relayout(2 * used)

    def clear(self) -> None:
        """Release every extent and the memory."""
        self.table = ExtentTable()
        self.tensors = self._empty(0)
        self.generation += 1
        self.storage += 1

    def _relayout(self, capacity: int, last: int | None = None) -> None:
        """Copy the live extents, packed from row 0 (``last`` after the others), into new
        tensors of ``capacity`` rows."""
        old = self.table.extents()
        starts = self.table.packed(capacity, last)
        new = self._empty(capacity)
        for name, x in self.tensors.items():
            for h, (src, length) in old.items():
                new[name][:, starts[h]:starts[h] + length] = x[:, src:src + length]
        self.tensors = new
        self.generation += 1
        self.storage += 1

    def view(self, name: str, handle: int, n: int) -> torch.Tensor:
        """[H, n, *trail]: the first ``n`` rows of the extent in field ``name``."""
        start = self.table.start(handle)
        return self.tensors[name][:, start:start + n]


class MetaRows:
    """One index's meta rows: for each field of its pool, ``[H, n_f, *trail]`` filled rows in
    the index's extent (see the module docstring). ``absent`` names fields the index's
    readers ask for but its policy keeps none of (e.g. a page baseline's centroids): they
    read as these (empty) tensors."""

    def __init__(self, pool: MetaPool, own: bool,
                 absent: Mapping[str, torch.Tensor] | None = None):
        self.pool = pool
        self.own = own
        """The pool is this index's alone (released with it) rather than its layer's."""
        self.absent = dict(absent or {})
        self.handle: int | None = None
        self.counts = dict.fromkeys(pool.fields, 0)
        """Field -> filled rows."""
        self._views: dict[str, torch.Tensor] = {}
        self._views_at = -1  # the pool generation the views were read at

    def view(self, name: str) -> torch.Tensor:
        """[H, n, *trail]: the filled rows of field ``name`` (a view of the pool)."""
        if self._views_at != self.pool.generation:
            self._views, self._views_at = {}, self.pool.generation
        v = self._views.get(name)
        if v is None:
            if name not in self.counts:
                return self.absent[name]
            n = self.counts[name]
            v = self.pool.view(name, self.handle, n) if self.handle is not None else \
                self.pool.tensors[name][:, :0]
            self._views[name] = v
        return v

    def shared_start(self) -> int | None:
        """The extent's first row in a layer's pool (0 while it holds no extent: no rows,
        nothing there to read); None while the pool is the index's own."""
        if self.own:
            return None
        return 0 if self.handle is None else self.pool.table.start(self.handle)

    def capacity(self) -> int:
        """Rows of the extent (0: none)."""
        return 0 if self.handle is None else self.pool.table.length(self.handle)

    def append(self, rows: Mapping[str, torch.Tensor], headroom: int = 0) -> None:
        """Write ``rows`` (field -> [H, c, *trail]) after each field's filled rows; a full
        extent grows to >= 1.5x (plus ``headroom`` rows)."""
        unknown = set(rows) - set(self.counts)
        if unknown:
            raise ValueError(f"meta fields {sorted(unknown)}; accepted: {list(self.counts)}")
        need = max(self.counts[name] + r.shape[1] for name, r in rows.items())
        held = self.capacity()
        if need > held:
            length = grown(need + headroom, held)
            if self.handle is None:
                self.handle = self.pool.reserve(length)
            else:
                self.pool.regrow(self.handle, length)
        start = self.pool.table.start(self.handle)
        for name, r in rows.items():
            n, c = self.counts[name], r.shape[1]
            self.pool.tensors[name][:, start + n:start + n + c] = r
            self.counts[name] = n + c
        self._views = {}

    def adopt(self, pool: MetaPool) -> None:
        """Move the rows into ``pool`` (a layer's, of the same layout), releasing this
        index's own pool."""
        if not pool.fits(self.pool.num_heads, self.pool.fields, self.pool.device):
            raise ValueError("adopt: the pool's layout differs from this index's meta rows")
        counts, held, handle = dict(self.counts), self.capacity(), None
        if held:
            handle = pool.reserve(held)
            src, dst = self.pool.table.start(self.handle), pool.table.start(handle)
            for name, x in self.pool.tensors.items():
                n = counts[name]
                pool.tensors[name][:, dst:dst + n] = x[:, src:src + n]
                if x.is_cuda:
                    # an own pool may come from the index builder's stream: its memory must
                    # not go back to that stream before this stream's copy has read it
                    x.record_stream(torch.cuda.current_stream(x.device))
        self.release()
        self.pool, self.own, self.handle, self.counts = pool, False, handle, counts
        self._views, self._views_at = {}, -1

    def release(self) -> None:
        """Give the extent back (and, when the pool is this index's own, its memory); the
        rows are empty after."""
        if self.handle is not None:
            self.pool.release(self.handle)
            self.handle = None
        if self.own:
            self.pool.clear()
        self.counts = dict.fromkeys(self.counts, 0)
        self._views = {}

    def nbytes(self) -> int:
        """Bytes of the extent (its filled rows and its room)."""
        return self.capacity() * self.pool.row_bytes()

