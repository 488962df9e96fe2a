"""Which requests are indexed, shared by the two scheduler-side parts in one process.

The connector (which decides when a request is indexed) writes it; the KV-cache manager
(which frees an indexed request's paged blocks) reads it. Both live in the engine-core
process next to the scheduler; request ids are unique within an engine.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_indexed_at: dict[str, int] = {}
_preempted = 0
_preempted_indexed = 0


def mark_indexed(request_id: str, num_tokens: int) -> None:
    """Record that ``request_id``'s index is built in the step that computes its first
    ``num_tokens`` tokens."""
    with _lock:
        _indexed_at[request_id] = num_tokens


def release(request_id: str, preempted: bool = False) -> None:
    """Forget ``request_id`` (finished, aborted or ``preempted``)."""
    global _preempted, _preempted_indexed
    with _lock:
        was_indexed = _indexed_at.pop(request_id, None) is not None
        _preempted += preempted
        _preempted_indexed += preempted and was_indexed


def num_preempted() -> tuple[int, int]:
    """(all, indexed) requests preempted in this process's scheduler (monotonic)."""
    with _lock:
        return _preempted, _preempted_indexed


def indexed_at(request_id: str) -> int | None:
    """Tokens covered by ``request_id``'s index when it was built, or None if not indexed."""
    with _lock:
        return _indexed_at.get(request_id)


def num_indexed() -> int:
    """Requests currently marked as indexed."""
    with _lock:
        return len(_indexed_at)
