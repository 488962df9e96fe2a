"""The haystack: lines of real prose (CPython's language reference), and prompt sizing."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from vllm_retro.capture import real_prose

#: Every line of the prose corpus; haystacks are windows of it.
CORPUS_CHARS = 400_000


@functools.lru_cache(maxsize=1)
def prose_lines() -> tuple[str, ...]:
    """The prose corpus (~400K characters) as lines; blank lines separate paragraphs."""
    return tuple(real_prose(CORPUS_CHARS).split("\n"))


def window(start: int, n_lines: int) -> list[str]:
    """``n_lines`` consecutive prose lines from line ``start`` (wrapping around the corpus)."""
    lines = prose_lines()
    return [lines[(start + i) % len(lines)] for i in range(n_lines)]


def boundary(weights: Sequence[int], depth: float) -> int:
    """The line boundary (0..len) whose cumulative ``weights`` (tokens per line) before it is
    nearest to ``depth`` (0 = start, 1 = end) of the total."""
    goal = max(0.0, min(1.0, depth)) * sum(weights)
    best, acc, best_err = 0, 0, goal
    for i, w in enumerate(weights):
        acc += w
        if abs(acc - goal) < best_err:
            best, best_err = i + 1, abs(acc - goal)
    return best


def insert_at_depths(lines: Sequence[str], inserts: Sequence[tuple[float, str]],
                     weights: Sequence[int] | None = None) -> str:
    """Join ``lines`` with the ``(depth, text)`` inserts placed as their own paragraphs at the
    line boundary nearest to ``depth`` of the haystack, measured in ``weights`` (tokens per
    line; 1 per line when not given)."""
    out = list(lines)
    w = list(weights[: len(lines)]) if weights is not None else [1] * len(lines)
    # Insert deepest first so earlier indices stay valid.
    for depth, text in sorted(inserts, key=lambda d: -d[0]):
        at = boundary(w, depth)
        out[at:at] = ["", text, ""]
    return "\n".join(out)


def fit(build: Callable[[int], str], count_tokens: Callable[[str], int], target: int,
        hi: int) -> tuple[int, str]:
    """The largest ``n`` in [0, ``hi``] with ``count_tokens(build(n)) <= target`` (``build``
    must grow with ``n``), found by bisection; returns ``(n, build(n))``."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo, build(lo)
