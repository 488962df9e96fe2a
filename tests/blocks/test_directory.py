"""vllm_retro.blocks.directory: blocks named by content, pages handed out and taken back,
least recently used first out, never a pinned one."""

from __future__ import annotations

import random

import pytest

from vllm_retro.blocks.directory import BlockDirectory, block_digest


def committed(d: BlockDirectory, name: str, tokens: int, position: int = 0):
    e = d.reserve(name, tokens, position)
    assert e is not None
    d.commit(e)
    return e


def test_a_block_is_named_by_its_tokens_under_its_namespace():
    a = block_digest("qwen/fp32", [1, 2, 3])
    assert a == block_digest("qwen/fp32", [1, 2, 3])
    assert a != block_digest("qwen/bf16", [1, 2, 3])
    assert a != block_digest("qwen/fp32", [1, 2, 3, 0])
    assert a != block_digest("qwen/fp32", [3, 2, 1])


def test_lookups_and_least_recently_used_eviction():
    d = BlockDirectory(num_pages=6, page_tokens=16)
    assert d.acquire("a") is None
    committed(d, "a", 32)  # 2 pages
    committed(d, "b", 17)  # 2 pages
    committed(d, "c", 16, position=40)  # 1 page
    assert d.stats.pages_used == 5 and d.stats.blocks == 3
    hit = d.acquire("a")  # a becomes the most recent: b is now the oldest
    assert hit is not None and hit.pages == [0, 1]
    d.release(hit)
    e = d.reserve("d", 40, 0)  # 3 pages: 1 free, b's 2 evicted
    assert e is not None and d.stats.evictions == 1
    assert "b" not in d and "a" in d and "c" in d
    assert "d" not in d  # being written: not readable, a miss
    assert d.acquire("d") is None
    d.commit(e)
    assert d.acquire("d") is e and e.position == 0
    assert d.stats.inserts == 4


def test_pinned_blocks_stay_and_a_block_without_room_is_rejected():
    d = BlockDirectory(num_pages=4, page_tokens=8)
    committed(d, "a", 16)
    committed(d, "b", 16)
    reading = d.acquire("a")
    assert d.reserve("c", 24, 0) is None  # 3 pages; only b's 2 can go
    assert d.stats.rejected == 1 and "a" in d and "b" in d
    assert d.reserve("huge", 100, 0) is None and d.stats.rejected == 2
    c = d.reserve("c", 16, 0)  # b goes, a is pinned
    assert c is not None and "a" in d and "b" not in d
    assert d.reserve("c", 16, 0) is None  # being written already
    d.release(reading)
    with pytest.raises(RuntimeError, match="released more often"):
        d.release(reading)


def test_a_discarded_block_gives_its_pages_back():
    d = BlockDirectory(num_pages=3, page_tokens=4)
    e = d.reserve("a", 12, 5)
    assert d.stats.pages_used == 3
    d.discard(e)
    assert d.stats.pages_used == 0 and "a" not in d and d.stats.inserts == 0
    with pytest.raises(RuntimeError, match="not being written"):
        d.commit(e)
    again = d.reserve("a", 12, 5)
    assert sorted(again.pages) == [0, 1, 2]


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="page_tokens must be >= 1, got 0"):
        BlockDirectory(num_pages=4, page_tokens=0)
    d = BlockDirectory(num_pages=4, page_tokens=4)
    with pytest.raises(ValueError, match="at least one token, got 0"):
        d.reserve("a", 0, 0)
    with pytest.raises(ValueError, match="position must be >= 0, got -3"):
        d.reserve("a", 4, -3)


def test_random_operations_keep_every_page_owned_once():
    """Reserve, commit, discard, acquire and release at random: the pages of the blocks
    held and the free pages always partition the pool; pinned blocks are never evicted."""
    rng = random.Random(0)
    d = BlockDirectory(num_pages=40, page_tokens=8)
    writing, reading = [], []
    hits = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.35:
            e = d.reserve(f"b{rng.randrange(60)}", rng.randrange(1, 90), rng.randrange(1000))
            if e is not None:
                writing.append(e)
        elif op < 0.55 and writing:
            e = writing.pop(rng.randrange(len(writing)))
            (d.commit if rng.random() < 0.8 else d.discard)(e)
        elif op < 0.8:
            e = d.acquire(f"b{rng.randrange(60)}")
            if e is not None:
                reading.append(e)
                hits += 1
        elif reading:
            d.release(reading.pop(rng.randrange(len(reading))))
        held = [p for e in d._entries.values() for p in e.pages]
        assert sorted(held + d._free) == list(range(40)), step
        for e in writing + reading:
            assert d._entries.get(e.digest) is e, step  # pinned: still there
    assert d.stats.evictions > 0 and hits > 0 and d.stats.rejected > 0
