"""Which passages' KV is cached, where, and what goes when room runs out: integers only.

The scheduler side of the block cache. A passage (block) is named by its content: the
digest of its token ids under a namespace that fixes the model and KV layout. Its KV lives
in fixed-size pages of the workers' :class:`~vllm_retro.blocks.arena.BlockArena`; this
directory hands the pages out and takes them back, so every process agrees on the
layout without sending a tensor. A block is written once (``reserve`` then ``commit``, or
``discard`` when its request ends first), read by any number of requests (``acquire`` /
``release``: a pinned block is never evicted), and evicted least recently used first when a
new block needs its pages.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def block_digest(namespace: str, token_ids: Sequence[int]) -> str:
    """The name of a block: sha256 over ``namespace`` (model and KV layout) and its token
    ids (hex)."""
    h = hashlib.sha256(namespace.encode())
    h.update(b"\0")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.hexdigest()


@dataclass
class BlockEntry:
    """One cached block."""

    digest: str
    num_tokens: int
    position: int
    """Position of the block's first token when its KV was written (keys carry it)."""
    pages: list[int]
    """Arena pages holding its tokens in order, ``page_tokens`` each (the last partly)."""
    ready: bool = False
    """Committed: every layer written; readable."""
    pins: int = 0
    """Requests reading it now (the writer, until commit)."""


@dataclass
class DirectoryStats:
    """Counters since start (``inserts``..``rejected``) and what is held now."""

    inserts: int = 0
    evictions: int = 0
    rejected: int = 0
    """Blocks not cached: larger than the whole budget, or every page pinned."""
    blocks: int = 0
    pages_used: int = 0


@dataclass
class BlockDirectory:
    """See module docstring. ``num_pages`` pages of ``page_tokens`` tokens each."""

    num_pages: int
    page_tokens: int
    _entries: OrderedDict[str, BlockEntry] = field(default_factory=OrderedDict)
    _free: list[int] = field(default_factory=list)
    stats: DirectoryStats = field(default_factory=DirectoryStats)

    def __post_init__(self) -> None:
        if self.num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {self.num_pages}")
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first

    def pages_for(self, num_tokens: int) -> int:
        """Pages a block of ``num_tokens`` tokens takes."""
        return -(-num_tokens // self.page_tokens)

    def acquire(self, digest: str) -> BlockEntry | None:
        """The committed block named ``digest``, pinned for the caller (it becomes the most
        recently used), or None."""
        entry = self._entries.get(digest)
        if entry is None or not entry.ready:
            return None
        entry.pins += 1
        self._entries.move_to_end(digest)
        return entry

    def release(self, entry: BlockEntry) -> None:
        """Unpin a block taken by :meth:`acquire`."""
        if entry.pins <= 0:
            raise RuntimeError(f"block {entry.digest[:12]} released more often than acquired")
        entry.pins -= 1

    def reserve(self, digest: str, num_tokens: int, position: int) -> BlockEntry | None:
        """Pages for a new block, pinned for its writer until :meth:`commit` or
        :meth:`discard`; evicts least recently used unpinned blocks to make room. None when
        the block is cached or being written already, or cannot get room (``rejected``)."""
        if num_tokens < 1:
            raise ValueError(f"a block needs at least one token, got {num_tokens}")
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if digest in self._entries:
            return None
        need = self.pages_for(num_tokens)
        if need > self.num_pages - self.pinned_pages():
            self.stats.rejected += 1
            return None
        while len(self._free) < need:
            self._evict_one()
        pages = [self._free.pop() for _ in range(need)]
        entry = BlockEntry(digest, num_tokens, position, pages, pins=1)
        self._entries[digest] = entry
        self._count()
        return entry

    def commit(self, entry: BlockEntry) -> None:
        """The writer wrote every layer: the block is readable from now on."""
        if entry.ready or self._entries.get(entry.digest) is not entry:
            raise RuntimeError(f"block {entry.digest[:12]} is not being written")
        entry.ready = True
        entry.pins -= 1
        self.stats.inserts += 1
        self._count()

    def discard(self, entry: BlockEntry) -> None:
        """Drop a block being written (its request ended first): its pages go back."""
        if entry.ready or self._entries.get(entry.digest) is not entry:
            raise RuntimeError(f"block {entry.digest[:12]} is not being written")
        del self._entries[entry.digest]
        self._free.extend(reversed(entry.pages))
        self._count()

    def __contains__(self, digest: str) -> bool:
        entry = self._entries.get(digest)
        return entry is not None and entry.ready

    def pinned_pages(self) -> int:
        """Pages of blocks being read or written now (never evicted)."""
        return sum(len(e.pages) for e in self._entries.values() if e.pins)

    def _evict_one(self) -> None:
        for digest, entry in self._entries.items():  # oldest first
            if not entry.pins:
                del self._entries[digest]
                self._free.extend(reversed(entry.pages))
                self.stats.evictions += 1
                self._count()
                return
        raise AssertionError("no unpinned block to evict although room was checked")

    def _count(self) -> None:
        self.stats.blocks = sum(1 for e in self._entries.values() if e.ready)
        self.stats.pages_used = self.num_pages - len(self._free)
