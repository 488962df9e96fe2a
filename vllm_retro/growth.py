"""How every preallocated pool grows when it is too small: one rule, one owner."""

from __future__ import annotations


def grown(need: int, held: int) -> int:
    """The new size of a pool holding ``held`` entries (rows, pages, slots, elements) that
    must hold ``need``: at least 1.5x ``held``, so a pool filled one request or block at a
    time is copied O(log n) times and each entry O(1) times on average, and never less than
    ``need``."""
    return max(need, held + held // 2)
