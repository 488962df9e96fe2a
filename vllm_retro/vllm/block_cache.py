"""Block-Attention's passage cache in the engine: each passage's KV computed once, kept in
host memory by content, and loaded into a later request's paged KV at its new position.

A Block-Attention request (:mod:`vllm_retro.blocks.request`) prefills every passage
attending only to itself, so a passage's KV depends on its tokens alone, and on its
position only through the rotation RoPE applies to its keys. So:

- **save**: at the step that computes a passage's last token, the scheduler reserves pages
  for it in the :class:`~vllm_retro.blocks.directory.BlockDirectory` (unless it is cached)
  and the workers copy its KV, every layer, from the paged cache into their
  :class:`~vllm_retro.blocks.arena.BlockArena` after the forward; the block is readable once
  every worker reported it written;
- **load**: when a request starts (or restarts after preemption), the passages from its
  first token not computed yet that are cached, up to the first that is not, are offered to
  vLLM as external tokens (``get_num_new_matched_tokens``); once vLLM allocated their
  slots, the workers write them into the paged cache before the forward, keys moved from
  the position they were written at to their new one
  (:class:`~vllm_retro.blocks.rope.RopeShift`), and vLLM computes only the rest.

The last block (the question) is never cached, so every request computes at least one
token. :class:`BlockCachePlanner` is the scheduler's half (integers only; what it sends is
:class:`BlockTransfer`), :class:`BlockCacheWorker` the workers'.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_retro.blocks.arena import BlockArena
from vllm_retro.blocks.directory import BlockDirectory, BlockEntry, block_digest
from vllm_retro.blocks.request import recompute_start
from vllm_retro.blocks.rope import RopeShift

logger = logging.getLogger("vllm.retro.block_cache")

PAGE_TOKENS = 32
"""Tokens per page of the passage cache (a ~500-token passage wastes < 32 tokens)."""
GiB = 1 << 30


def cache_pages(cache_gb: float, kv_bytes_per_token: int) -> int:
    """Pages of :data:`PAGE_TOKENS` tokens that ``cache_gb`` GiB hold, at
    ``kv_bytes_per_token`` (K+V of every cached layer of one worker): the same on the
    scheduler and on every worker."""
    if kv_bytes_per_token <= 0:
        return 0
    return int(cache_gb * GiB) // (PAGE_TOKENS * kv_bytes_per_token)


@dataclass(frozen=True, slots=True)
class PassageLoad:
    """Tokens ``[first, first + count)`` of a cached passage, written to a request's
    positions ``[dst, dst + count)``."""

    pages: tuple[int, ...]
    src: int
    """Position of the passage's first token when its keys were written."""
    first: int
    count: int
    dst: int


@dataclass(frozen=True, slots=True)
class PassageSave:
    """A passage computed by this step: its tokens at positions ``[start, start +
    num_tokens)`` of the request, copied into ``pages``."""

    digest: str
    pages: tuple[int, ...]
    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """One request's passage loads (before this step's forward) and saves (after it)."""

    block_ids: tuple[int, ...]
    """The request's block-table row in the retro KV-cache group."""
    loads: tuple[PassageLoad, ...] = ()
    saves: tuple[PassageSave, ...] = ()


@dataclass
class PassageCounts:
    """Scheduler counters since start (exported as ``vllm_retro:block_cache_*``)."""

    hits: int = 0
    """Passages loaded from the cache (wholly, or up to where vLLM cut the load or the
    recomputed tail begins) instead of prefilled."""
    misses: int = 0
    """Passages of Block-Attention requests prefilled, none of their tokens loaded (not
    cached, after the first passage that was not: loads are contiguous from the request's
    first token, or in the recomputed tail)."""
    loaded_tokens: int = 0
    saved_tokens: int = 0


@dataclass
class BlockCachePlanner:
    """The scheduler's half (see module docstring): which passages a request loads, which
    it saves, and when the pages they pin go back.

    Args:
        directory: the cache's pages (its page size :data:`PAGE_TOKENS`).
        namespace: names the model and KV layout in every passage's digest.
        bytes_per_token: K+V bytes of one token, every cached layer of one worker.
        recompute_tokens: the setting ``block_recompute_tokens``: passages' tokens from
            :func:`~vllm_retro.blocks.request.recompute_start` on are neither loaded nor
            saved (they are computed against the whole prompt).
    """

    directory: BlockDirectory
    namespace: str
    bytes_per_token: int
    recompute_tokens: int = 0
    counts: PassageCounts = field(default_factory=PassageCounts)
    _offered: dict[str, tuple[int, list[tuple[BlockEntry, PassageLoad]]]] = field(
        default_factory=dict)
    """Offers to vLLM not allocated yet: the first token offered, and the loads (pinned)."""
    _loading: dict[str, list[tuple[BlockEntry, PassageLoad]]] = field(default_factory=dict)
    """Loads allocated, to be sent with the request's next step (pinned)."""
    _sent: list[BlockEntry] = field(default_factory=list)
    """Blocks read by the last step sent (pinned until the next step is planned: workers
    run steps in order, so that step's loads precede any later write to their pages)."""
    _writing: dict[str, BlockEntry] = field(default_factory=dict)
    """Blocks being written, by digest (pinned by their writer until reported)."""
    _digests: dict[str, tuple[tuple[int, ...], list[str]]] = field(default_factory=dict)
    """Each live request's block starts and passage digests, computed once."""

    def passages(self, request_id: str, token_ids: Sequence[int], blocks: Sequence[int]
                 ) -> list[str]:
        """Digests of the request's passages (every block but the last)."""
        known = self._digests.get(request_id)
        if known is None or known[0] != tuple(blocks):
            digests = [block_digest(self.namespace, token_ids[s:e])
                       for s, e in zip(blocks[:-1], blocks[1:], strict=True)]
            known = self._digests[request_id] = (tuple(blocks), digests)
        return known[1]

    def offer(self, request_id: str, token_ids: Sequence[int], blocks: Sequence[int],
              num_computed: int) -> int:
        """Tokens from ``num_computed`` the cache can supply: every passage from there up to
        the first not cached (the one holding ``num_computed`` from that token on), and not
        past :func:`~vllm_retro.blocks.request.recompute_start`. Pins them until
        :meth:`allocated` (an earlier offer to the same request is taken back)."""
        self._unpin(e for e, _ in self._offered.pop(request_id, (0, []))[1])
        digests = self.passages(request_id, token_ids, blocks)
        limit = recompute_start(blocks, self.recompute_tokens)
        pos, items = num_computed, []
        for digest, s, e in zip(digests, blocks[:-1], blocks[1:], strict=True):
            if e <= pos:
                continue
            if pos >= limit:
                break
            entry = self.directory.acquire(digest)
            if entry is None:
                break
            end = min(e, limit)
            items.append((entry, PassageLoad(tuple(entry.pages), entry.position,
                                             pos - s, end - pos, pos)))
            pos = end
        self._offered[request_id] = (num_computed, items)
        return pos - num_computed

    def allocated(self, request_id: str, num_external: int) -> None:
        """vLLM allocated the request's slots with ``num_external`` tokens to load from
        where :meth:`offer` started (0: none; fewer than offered: the loads are cut there).
        Counts the request's hits and misses."""
        if request_id not in self._offered:
            return
        first, items = self._offered.pop(request_id)
        kept, left = [], num_external
        for entry, load in items:
            if left <= 0:
                self.directory.release(entry)
                continue
            if load.count > left:
                load = dataclasses.replace(load, count=left)
            kept.append((entry, load))
            left -= load.count
        if kept:
            self._loading[request_id] = kept
        starts = self._digests[request_id][0][:-1]
        self.counts.hits += len(kept)
        self.counts.misses += sum(1 for s in starts if s >= first + num_external)
        self.counts.loaded_tokens += num_external

    def transfer(self, request_id: str, token_ids: Sequence[int],
                 blocks: Sequence[int] | None, first: int, end: int,
                 block_ids: Sequence[int]) -> BlockTransfer | None:
        """This step's loads and saves for a request computing tokens ``[first, end)``
        (``blocks``: its block starts while it computes passages, else None), or None."""
        loads = self._loading.pop(request_id, [])
        self._sent.extend(entry for entry, _ in loads)
        saves = []
        if blocks is not None:
            digests = self.passages(request_id, token_ids, blocks)
            limit = recompute_start(blocks, self.recompute_tokens)
            for digest, s, e in zip(digests, blocks[:-1], blocks[1:], strict=True):
                if not first < e <= min(end, limit) or digest in self._writing:
                    continue
                entry = self.directory.reserve(digest, e - s, s)
                if entry is not None:
                    self._writing[digest] = entry
                    saves.append(PassageSave(digest, tuple(entry.pages), s, e - s))
        if not loads and not saves:
            return None
        return BlockTransfer(tuple(block_ids), tuple(load for _, load in loads), tuple(saves))

    def step_planned(self) -> None:
        """A new step is being planned: the blocks the previous step read are unpinned."""
        self._unpin(self._sent)
        self._sent = []

    def saved(self, written: set[str], failed: set[str]) -> None:
        """Workers reported passages written (readable from now on) or failed (dropped)."""
        for digest in written | failed:
            entry = self._writing.pop(digest, None)
            if entry is None:
                continue
            if digest in failed:
                self.directory.discard(entry)
            else:
                self.directory.commit(entry)
                self.counts.saved_tokens += entry.num_tokens

    def finished(self, request_id: str) -> None:
        """The request ended or was preempted: its unsent loads' pins go back."""
        self._unpin(e for e, _ in self._offered.pop(request_id, (0, []))[1])
        self._unpin(e for e, _ in self._loading.pop(request_id, []))
        self._digests.pop(request_id, None)

    def _unpin(self, entries: Iterable[BlockEntry]) -> None:
        for entry in entries:
            self.directory.release(entry)


def model_rope(head_size: int) -> RopeShift:
    """The served model's rotary embedding as a :class:`RopeShift`, found among the ones
    vLLM built (``get_rope`` keeps each in a module-level dict, the only place they are
    reachable from outside the model). Raises RuntimeError unless exactly one plain
    per-position rotary embedding of ``head_size`` exists (multimodal, long-RoPE and
    dual-chunk variants do not move keys by one rotation per position)."""
    from vllm.model_executor.layers import rotary_embedding as re

    plain = {"RotaryEmbedding", "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding",
             "YaRNScalingRotaryEmbedding", "NTKScalingRotaryEmbedding",
             "DynamicNTKScalingRotaryEmbedding"}
    found = {id(m): m for m in getattr(re, "_ROPE_DICT", {}).values()
             if getattr(m, "head_size", None) == head_size}
    ok = [m for m in found.values() if type(m).__name__ in plain]
    if len(found) != 1 or len(ok) != 1:
        kinds = sorted(type(m).__name__ for m in found.values())
        raise RuntimeError(f"passage KV cannot be moved between positions: the model's rotary "
                           f"embeddings of head size {head_size} are {kinds or 'none'}; "
                           f"supported: exactly one of {sorted(plain)}")
    m = ok[0]
    return RopeShift(m.cos_sin_cache, head_size, bool(m.is_neox_style))


class BlockCacheWorker:
    """The workers' half (see module docstring): the arena, and the loads and saves of
    each step through the attention layers' own cache write and read.

    Args:
        layer_names: the retro group's attention layers, in model order (arena layer i).
        num_pages: as the planner's directory.
        kv_heads, head_size, dtype: this worker's KV layout.
        block_size: tokens per block of vLLM's paged cache.
        rope: moves keys between positions (None: :func:`model_rope` at first use).
    """

    def __init__(self, layer_names: Sequence[str], num_pages: int, kv_heads: int,
                 head_size: int, dtype: torch.dtype, block_size: int,
                 rope: RopeShift | None = None):
        self.layer_names = list(layer_names)
        self.num_pages = num_pages
        self.kv_heads, self.head_size, self.dtype = kv_heads, head_size, dtype
        self.block_size = block_size
        self._rope = rope
        self._arena: BlockArena | None = None
        self.written: set[str] = set()
        self.failed: set[str] = set()
        """Passages saved (or not) since the last report."""
        self._warned = False

    @property
    def arena(self) -> BlockArena:
        """The page pool, allocated at first use (untouched pages cost address space)."""
        if self._arena is None:
            self._arena = BlockArena(self.num_pages, PAGE_TOKENS, len(self.layer_names),
                                     self.kv_heads, self.head_size, self.dtype)
        return self._arena

    @property
    def rope(self) -> RopeShift:
        if self._rope is None:
            self._rope = model_rope(self.head_size)
        return self._rope

    def _slots(self, block_ids: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def load(self, transfer: BlockTransfer, layers: Mapping[str, Any]) -> None:
        """Write ``transfer``'s loads into the paged cache of every layer in ``layers``
        (name -> vLLM attention layer, whose ``impl.do_kv_cache_update`` writes its cache),
        keys moved to their positions. Raises on any failure (the request then fails)."""
        if not transfer.loads:
            return
        arena = self.arena
        pages, offs, src, dst = [], [], [], []
        for load in transfer.loads:
            t = torch.arange(load.first, load.first + load.count)
            pages.append(torch.tensor(load.pages)[t // PAGE_TOKENS])
            offs.append(t % PAGE_TOKENS)
            src.append(t + load.src)
            dst.append(torch.arange(load.dst, load.dst + load.count))
        page, off = torch.cat(pages), torch.cat(offs)
        dst_pos = torch.cat(dst)
        slots = self._slots(transfer.block_ids, dst_pos)
        rotation = None
        for i, name in enumerate(self.layer_names):
            layer = layers[name]
            dev = layer.kv_cache.device
            if rotation is None:
                rotation = self.rope.rotation(torch.cat(src), dst_pos, len(dst_pos), dev)
                slots = slots.to(dev)
            keys = self.rope.apply(arena.pool[page, i, 0, off].to(dev), rotation)
            values = arena.pool[page, i, 1, off].to(dev)
            layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)

    def save(self, transfer: BlockTransfer, layers: Mapping[str, Any]) -> None:
        """Copy ``transfer``'s saves from the paged cache into the arena (every layer, with
        the layer impl's ``read_kv``); each passage is recorded written or failed."""
        if not transfer.saves:
            return
        table = torch.tensor(transfer.block_ids, dtype=torch.long)
        for save in transfer.saves:
            try:
                self.rope  # noqa: B018 -- a passage that could never be loaded is not kept
                arena = self.arena
                end = save.start + save.num_tokens
                for i, name in enumerate(self.layer_names):
                    layer = layers[name]
                    keys, values = layer.impl.read_kv(layer, layer.kv_cache, table, end,
                                                      first=save.start)
                    arena.write(list(save.pages), i, keys.transpose(0, 1),
                                values.transpose(0, 1))
                self.written.add(save.digest)
            except Exception as exc:  # noqa: BLE001 -- the passage is prefilled next time
                if not self._warned:
                    self._warned = True
                    logger.warning("retro: a passage's KV was not cached (%r); it is "
                                   "prefilled again when it recurs", exc)
                self.failed.add(save.digest)

    def take_report(self) -> tuple[set[str], set[str]]:
        """Passages written and failed since the last call."""
        report = (self.written, self.failed)
        self.written, self.failed = set(), set()
        return report
