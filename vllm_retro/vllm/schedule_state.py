"""Which requests of an engine are indexed, shared by its two scheduler-side parts.

The connector (which decides when a request is indexed) writes it; the KV-cache manager
(which frees an indexed request's paged blocks) reads it. vLLM builds the manager from a
KV-cache spec and the block pool alone, so the one object both are handed is the retro
group's :class:`~vllm_retro.vllm.kv_manager.RetroAttentionSpec`: the manager as its
``kv_cache_spec``, the connector inside the scheduler's ``kv_cache_config``. The spec carries
a :class:`ScheduleState` (``RetroAttentionSpec.schedule``), so each engine — each scheduler's
KV-cache config — has its own. Both parts run on the engine core's scheduler thread; request
ids are unique within an engine.
"""

from __future__ import annotations


class ScheduleState:
    """Indexed requests of one engine's retro KV-cache group, and its preemption counts."""

    def __init__(self) -> None:
        self._indexed_at: dict[str, int] = {}
        self.preempted = 0
        """Requests preempted (monotonic)."""
        self.preempted_indexed = 0
        """Of those, the ones that were indexed."""

    def __reduce__(self) -> tuple:
        # a spec sent to another process (worker -> engine core) carries no requests
        return ScheduleState, ()

    def mark_indexed(self, request_id: str, num_tokens: int) -> None:
        """Record that ``request_id``'s index is built in the step that computes its first
        ``num_tokens`` tokens."""
        self._indexed_at[request_id] = num_tokens

    def release(self, request_id: str, preempted: bool = False) -> None:
        """Forget ``request_id`` (finished, aborted or ``preempted``)."""
        was_indexed = self._indexed_at.pop(request_id, None) is not None
        self.preempted += preempted
        self.preempted_indexed += preempted and was_indexed

    def indexed_at(self, request_id: str) -> int | None:
        """Tokens covered by ``request_id``'s index when it was built, or None if not
        indexed."""
        return self._indexed_at.get(request_id)

    def num_indexed(self) -> int:
        """Requests marked as indexed now."""
        return len(self._indexed_at)
