"""Which of a worker's requests left the indexed path, until the scheduler releases them.

Two fates: *demoted* (its index build failed: it decodes densely from its paged KV for
life; the scheduler, told once through :meth:`RequestFates.take_demoted`, keeps those blocks)
and *failed* (its index broke while decoding, or its passages could not load: the scheduler
ends it with an error to its client). Plain sets, the engine's thread only; the runtime
frees what such a request held and counts it (:mod:`vllm_retro.vllm.runtime`).
"""

from __future__ import annotations


class RequestFates:
    """See module docstring."""

    def __init__(self) -> None:
        self._demoted: set[str] = set()
        self._failed: dict[str, str] = {}
        """Failed requests, with why."""
        self._unreported: set[str] = set()
        """Demoted requests the scheduler has not been told of yet."""

    def demote(self, request_id: str) -> None:
        """``request_id`` decodes densely for life from now on."""
        self._demoted.add(request_id)
        self._unreported.add(request_id)

    def fail(self, request_id: str, reason: str) -> bool:
        """``request_id`` failed (``reason``); False when it had already."""
        if request_id in self._failed:
            return False
        self._failed[request_id] = reason
        return True

    def is_dense(self, request_id: str) -> bool:
        """Whether ``request_id`` decodes densely for life (demoted) or has failed."""
        return request_id in self._demoted or request_id in self._failed

    def has_failed(self, request_id: str) -> bool:
        """Whether ``request_id`` failed on this worker."""
        return request_id in self._failed

    def failed(self) -> set[str]:
        """The failed requests' ids (a copy)."""
        return set(self._failed)

    def take_demoted(self) -> set[str]:
        """Requests demoted since the last call."""
        out, self._unreported = self._unreported, set()
        return out

    def release(self, request_id: str) -> None:
        """Forget ``request_id`` (the scheduler released it)."""
        self._demoted.discard(request_id)
        self._failed.pop(request_id, None)
